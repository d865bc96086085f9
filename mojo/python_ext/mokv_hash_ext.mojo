"""Python extension module `mokv_hash_ext`: chained SHA-256 page hashes, all pages of a
token range in one call.

Built by python/mokv/extensions.py (cached by content hash); the Python side is
`mokv.cache.hashing`, which falls back to hashlib when this module cannot be built.
It imports nothing from the mokv kernel package, so it builds in seconds.

The definition is hashlib's (and vLLM's 64-bit form): page i's hash is the last 8 bytes,
read big-endian, of SHA-256(parent as 8 little-endian bytes || the page's token ids as
int64 little-endian), where the parent is page i-1's hash (or the given root).

Why native: hashlib costs ~0.9 us of OpenSSL per call on top of the compression itself,
which at 16 tokens a page is most of the time. Here one call hashes every page: each
page's message is laid out once in a scratch buffer whose padding is shared by all
pages (they have the same length), then compressed with the x86 SHA extensions
(sha256rnds2 / sha256msg1 / sha256msg2) when the build target has them, else with the
portable scalar rounds.
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


def _digest_tail_sha_ni(message: U8Ptr, num_blocks: Int) -> UInt64:
    """SHA-256 of `num_blocks` padded blocks: the digest's last 8 bytes, big-endian."""
    var abef = Words(_IV[5], _IV[4], _IV[1], _IV[0])
    var cdgh = Words(_IV[7], _IV[6], _IV[3], _IV[2])
    for b in range(num_blocks):
        _compress_sha_ni(abef, cdgh, message.unsafe_offset(64 * b))
    return (UInt64(cdgh[1]) << 32) | UInt64(cdgh[0])  # H6, H7


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


def _digest_tail_scalar(message: U8Ptr, num_blocks: Int) -> UInt64:
    var h = _IV
    for b in range(num_blocks):
        _compress_scalar(h, message.unsafe_offset(64 * b))
    return (UInt64(h[6]) << 32) | UInt64(h[7])


# ---- The chain ----------------------------------------------------------------------


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
    var scalar_rounds = not HAS_SHA_NI or Bool(py=portable)
    if n < 0 or size < 0 or size % 8 != 0:
        raise Error(t"ValueError: num_pages={n} must be >= 0 and page_bytes={size} a multiple of 8")
    # One padded message: parent (8 bytes) || tokens || 0x80 || zeros || bit length (BE).
    var length = 8 + size
    var num_blocks = (length + 8) // 64 + 1
    var scratch = List[UInt8](length=num_blocks * 64, fill=0)
    var message = U8Ptr(unsafe_from_address=Int(scratch.unsafe_ptr()))
    message.unsafe_store(length, 0x80)
    message.unsafe_offset(num_blocks * 64 - 8).unsafe_bitcast[UInt64]().unsafe_store(
        0, byte_swap(UInt64(length * 8))
    )
    var body = message.unsafe_offset(8).unsafe_bitcast[UInt64]()
    for i in range(n):
        message.unsafe_bitcast[UInt64]().unsafe_store(0, parent)  # little-endian (x86)
        var page = src.unsafe_offset(i * size).unsafe_bitcast[UInt64]()
        for j in range(size // 8):
            body.unsafe_store(j, page.unsafe_load(j))
        if scalar_rounds:
            parent = _digest_tail_scalar(message, num_blocks)
        else:
            comptime if HAS_SHA_NI:
                parent = _digest_tail_sha_ni(message, num_blocks)
        out.unsafe_store(i, parent)
    _ = scratch^
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
