"""Python extension module `mokv_hash_ext`: chained SHA-256 page hashes, all pages of a
token range in one call.

Built by python/mokv/extensions.py (cached by content hash); the Python side is
`mokv.cache.hashing`, which falls back to hashlib when this module cannot be built.
It imports nothing from the mokv kernel package, so it builds in seconds.

The definition is hashlib's (and vLLM's 64-bit form): page i's hash is the last 8 bytes,
read big-endian, of SHA-256(the page's token ids as int64 little-endian || parent as 8
little-endian bytes), where the parent is page i-1's hash (or the given root).

Why native: hashlib costs ~0.9 us of OpenSSL per call on top of the compression itself,
which at 16 tokens a page is most of the time. Here one call hashes every page, with the
x86 SHA extensions (sha256rnds2 / sha256msg1 / sha256msg2) when the build target has
them, else with the portable scalar rounds.

Why the parent comes last: a page's token blocks then do not depend on the chain, so two
pages' token blocks are compressed side by side (two independent dependency chains that
the core overlaps) and only the final block, which carries the parent, waits for the page
before. One chain of SHA rounds is bound by the latency of sha256rnds2: measured here,
35 ns per block alone and 25 ns per block with two chains interleaved, so a page of 128
tokens (17 blocks) takes about 0.45 us instead of 0.6 us (MAX 26.7's Rust sha256 takes
about 0.6 us).
"""

from std.bit import byte_swap, rotate_bits_right
from std.os import abort
from std.python import PythonObject
from std.python.bindings import PythonModuleBuilder
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget

comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]
comptime U64Ptr = Pointer[UInt64, MutUntrackedOrigin]
comptime Words = SIMD[DType.uint32, 4]

comptime HAS_SHA_NI = CompilationTarget._has_feature["sha"]()
"""Whether the build target (the building machine's CPU) has the SHA extensions."""

comptime _K = SIMD[DType.uint32, 64](
    0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
    0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
    0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
    0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
    0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
    0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
    0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
    0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2,
)
"""SHA-256's round constants."""

comptime _IV = SIMD[DType.uint32, 8](
    0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19
)
"""SHA-256's initial state H0..H7."""


# ---- The SHA extensions: the state lives as (A, B, E, F) and (C, D, G, H) -----------


@always_inline
def _rnds2(cdgh: Words, abef: Words, wk: Words) -> Words:
    """Two rounds (message words + constants in lanes 0-1 of `wk`); returns the new ABEF."""
    return llvm_intrinsic["llvm.x86.sha256rnds2", Words](cdgh, abef, wk)


@always_inline
def _msg1(w0: Words, w4: Words) -> Words:
    return llvm_intrinsic["llvm.x86.sha256msg1", Words](w0, w4)


@always_inline
def _msg2(w: Words, w12: Words) -> Words:
    return llvm_intrinsic["llvm.x86.sha256msg2", Words](w, w12)


@always_inline
def _compress_sha_ni(mut abef: Words, mut cdgh: Words, block: U8Ptr):
    """One 64-byte block into the state, 4 rounds per message vector (16 groups)."""
    var w = block.unsafe_bitcast[UInt32]()
    var m = Array[Words, 4](fill=Words(0))
    var abef0 = abef
    var cdgh0 = cdgh
    comptime for g in range(16):
        comptime if g < 4:
            m[g] = byte_swap(w.unsafe_load[width=4](4 * g))  # big-endian words
        else:
            var prev = m[(g + 3) % 4]  # W[4g-4 .. 4g-1]
            var w9_12 = m[(g + 2) % 4].shuffle[1, 2, 3, 4](prev)  # W[4g-7 .. 4g-4]
            m[g % 4] = _msg2(_msg1(m[g % 4], m[(g + 1) % 4]) + w9_12, prev)
        var wk = m[g % 4] + _K.slice[4, offset = 4 * g]()
        cdgh = _rnds2(cdgh, abef, wk)  # cdgh now holds ABEF, abef the new CDGH
        abef = _rnds2(abef, cdgh, wk.shuffle[2, 3, 0, 1]())
    abef += abef0
    cdgh += cdgh0


# ---- Portable scalar rounds ---------------------------------------------------------


def _compress_scalar(mut h: SIMD[DType.uint32, 8], block: U8Ptr):
    var w = Array[UInt32, 64](fill=0)
    var words = block.unsafe_bitcast[UInt32]()
    for i in range(16):
        w[i] = byte_swap(words.unsafe_load(i))
    for i in range(16, 64):
        var x = w[i - 15]
        var y = w[i - 2]
        var s0 = rotate_bits_right[7](x) ^ rotate_bits_right[18](x) ^ (x >> 3)
        var s1 = rotate_bits_right[17](y) ^ rotate_bits_right[19](y) ^ (y >> 10)
        w[i] = w[i - 16] + s0 + w[i - 7] + s1
    var a = h[0]
    var b = h[1]
    var c = h[2]
    var d = h[3]
    var e = h[4]
    var f = h[5]
    var g = h[6]
    var hh = h[7]
    for i in range(64):
        var s1 = rotate_bits_right[6](e) ^ rotate_bits_right[11](e) ^ rotate_bits_right[25](e)
        var t1 = hh + s1 + ((e & f) ^ (~e & g)) + _K[i] + w[i]
        var s0 = rotate_bits_right[2](a) ^ rotate_bits_right[13](a) ^ rotate_bits_right[22](a)
        var t2 = s0 + ((a & b) ^ (a & c) ^ (b & c))
        hh = g
        g = f
        f = e
        e = d + t1
        d = c
        c = b
        b = a
        a = t1 + t2
    h += SIMD[DType.uint32, 8](a, b, c, d, e, f, g, hh)


# ---- The chain ----------------------------------------------------------------------
#
# The state is kept as the SHA extensions want it: ABEF and CDGH (H5 H4 H1 H0 and
# H7 H6 H3 H2 in lanes 0-3); the scalar rounds unpack and repack it per block.

comptime _IV_ABEF = Words(_IV[5], _IV[4], _IV[1], _IV[0])
comptime _IV_CDGH = Words(_IV[7], _IV[6], _IV[3], _IV[2])

comptime _LANES = 2
"""Pages whose token blocks are compressed side by side. Measured at page 128 (M tokens/s,
three runs each, MAX's Rust sha256 in the same runs 176-218): 1 page 178-207, 2 pages
225-267, 4 pages 195-233 (four states and their message words no longer fit the 16 xmm
registers the SHA instructions use)."""


@always_inline
def _compress[sha_ni: Bool](mut abef: Words, mut cdgh: Words, block: U8Ptr):
    comptime if sha_ni:
        _compress_sha_ni(abef, cdgh, block)
    else:
        var h = SIMD[DType.uint32, 8](
            abef[3], abef[2], cdgh[3], cdgh[2], abef[1], abef[0], cdgh[1], cdgh[0]
        )
        _compress_scalar(h, block)
        abef = Words(h[5], h[4], h[1], h[0])
        cdgh = Words(h[7], h[6], h[3], h[2])


@always_inline
def _finish[
    sha_ni: Bool
](
    var abef: Words,
    var cdgh: Words,
    tail: U8Ptr,
    tail_bytes: Int,
    parent: UInt64,
    last_blocks: U8Ptr,
    num_final: Int,
) -> UInt64:
    """The page's hash from the state after its whole token blocks: the final block(s)
    hold the last `tail_bytes` token bytes, the parent, and the padding already laid
    out in `last_blocks`. Returns the digest's last 8 bytes read big-endian (H6, H7)."""
    var words = last_blocks.unsafe_bitcast[UInt64]()
    var src = tail.unsafe_bitcast[UInt64]()
    for j in range(tail_bytes // 8):
        words.unsafe_store(j, src.unsafe_load(j))
    words.unsafe_store(tail_bytes // 8, parent)  # little-endian (x86)
    for b in range(num_final):
        _compress[sha_ni](abef, cdgh, last_blocks.unsafe_offset(64 * b))
    return (UInt64(cdgh[1]) << 32) | UInt64(cdgh[0])


def _chain[sha_ni: Bool](src: U8Ptr, n: Int, size: Int, root: UInt64, hashes: U64Ptr):
    """Hashes `n` pages of `size` token bytes at `src`, chained from `root`, into `hashes`:
    `_LANES` pages at a time, their token blocks interleaved, their final blocks in order."""
    var full = size // 64  # blocks of tokens only
    var tail_bytes = size - 64 * full
    var length = size + 8  # the message: tokens || parent
    var num_final = 1 if tail_bytes + 8 + 9 <= 64 else 2  # + 0x80 and the bit length
    var scratch = List[UInt8](length=128, fill=0)
    var last_blocks = U8Ptr(unsafe_from_address=Int(scratch.unsafe_ptr()))
    last_blocks.unsafe_store(tail_bytes + 8, 0x80)
    last_blocks.unsafe_offset(64 * num_final - 8).unsafe_bitcast[UInt64]().unsafe_store(
        0, byte_swap(UInt64(length * 8))
    )
    var parent = root
    for i in range(0, n, _LANES):
        var lanes = min(_LANES, n - i)
        var abef = Array[Words, _LANES](fill=_IV_ABEF)
        var cdgh = Array[Words, _LANES](fill=_IV_CDGH)
        for b in range(full):
            comptime for lane in range(_LANES):
                if lane < lanes:
                    _compress[sha_ni](
                        abef[lane], cdgh[lane], src.unsafe_offset((i + lane) * size + 64 * b)
                    )
        for lane in range(lanes):
            var tail = src.unsafe_offset((i + lane) * size + 64 * full)
            parent = _finish[sha_ni](
                abef[lane], cdgh[lane], tail, tail_bytes, parent, last_blocks, num_final
            )
            hashes.unsafe_store(i + lane, parent)
    _ = scratch^


def chain_sha256(
    tokens_address: PythonObject,
    num_pages: PythonObject,
    page_bytes: PythonObject,
    parent_bits: PythonObject,
    out_address: PythonObject,
    portable: PythonObject,
) raises -> PythonObject:
    """Writes the chained hashes of `num_pages` consecutive pages to `out_address`.

    `tokens_address`: `num_pages * page_bytes` bytes (int64 little-endian token ids);
    `parent_bits`: the first page's parent as an int64 (the uint64's bits);
    `out_address`: room for `num_pages` uint64. The caller keeps both buffers alive.
    `portable`: use the scalar rounds even where the SHA extensions are built in (so that
    tests check both paths against hashlib on this machine).
    """
    var src = U8Ptr(unsafe_from_address=Int(py=tokens_address))
    var out = U64Ptr(unsafe_from_address=Int(py=out_address))
    var n = Int(py=num_pages)
    var size = Int(py=page_bytes)
    var parent = Scalar[DType.int64](Int(py=parent_bits)).cast[DType.uint64]()
    if n < 0 or size < 0 or size % 8 != 0:
        raise Error(t"ValueError: num_pages={n} must be >= 0 and page_bytes={size} a multiple of 8")
    comptime if HAS_SHA_NI:
        if not Bool(py=portable):
            _chain[True](src, n, size, parent, out)
            return PythonObject(None)
    _chain[False](src, n, size, parent, out)
    return PythonObject(None)


def uses_sha_extensions() raises -> PythonObject:
    """Whether this build compresses with the x86 SHA extensions (else scalar rounds)."""
    return PythonObject(HAS_SHA_NI)


@export
def PyInit_mokv_hash_ext() abi("C") -> PythonObject:
    try:
        var b = PythonModuleBuilder("mokv_hash_ext")
        b.def_function[chain_sha256](
            "chain_sha256",
            docstring=(
                "chain_sha256(tokens_address, num_pages, page_bytes, parent_bits, out_address,"
                " portable)"
            ),
        )
        b.def_function[uses_sha_extensions]("uses_sha_extensions")
        return b.finalize()
    except e:
        abort(t"failed to build mokv_hash_ext: {e}")
