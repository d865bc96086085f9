"""Python extension module `mokv_hash_ext`: chained SHA-256 and XXH3-64 page hashes, all
pages of a token range in one call.

Built by python/mokv/extensions.py (cached by content hash); the Python side is
`mokv.cache.hashing`, which falls back to hashlib and the xxhash package when this
module cannot be built.
It imports nothing from the mokv kernel package, so it builds in seconds.

SHA-256. The definition is hashlib's (and vLLM's 64-bit form): page i's hash is the last
8 bytes, read big-endian, of SHA-256(the page's token ids as int64 little-endian || parent
as 8 little-endian bytes), where the parent is page i-1's hash (or the given root).

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

XXH3-64. The definition is the `xxhash` package's `xxh3_64_intdigest(page bytes,
seed=parent)` (XXH3_64bits_withSeed), implemented here from the xxHash specification.
Why native: the package's per-call cost (~0.1-0.3 us from Python) is most of the time at
16 tokens a page, where the hash itself takes ~11 ns here. The chain is serial (a page's
seed is the page before's hash), so the speed comes from the per-page work alone: pages
over 240 bytes run the 8 accumulators as one SIMD[DType.uint64, 8] (one AVX-512 register
here, ~46 ns a 1 KiB page). Nothing in it is target-specific: LLVM splits the vector on
narrower targets, so the same code is the generic path (a build for plain x86-64, SSE2
only, gives the same hashes).
"""

from std.bit import byte_swap, rotate_bits_left, rotate_bits_right
from std.math import iota
from std.memory import bitcast
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


# ---- XXH3-64 ------------------------------------------------------------------------
#
# XXH3_64bits_withSeed as the xxHash specification defines it, for every length class a
# page of int64 tokens can fall in: 8 bytes (4-8), 16 (9-16), 24-128, 136-240, and longer.
# Page bytes are a multiple of 8 and at least 8, so the 0 and 1-3 byte classes never occur.

comptime Lanes = SIMD[DType.uint64, 8]
"""XXH3's 8 accumulators of a long input: one AVX-512 register."""

comptime _PRIME32_1 = UInt64(0x9E3779B1)
comptime _PRIME32_2 = UInt64(0x85EBCA77)
comptime _PRIME32_3 = UInt64(0xC2B2AE3D)
comptime _PRIME64_1 = UInt64(0x9E3779B185EBCA87)
comptime _PRIME64_2 = UInt64(0xC2B2AE3D27D4EB4F)
comptime _PRIME64_3 = UInt64(0x165667B19E3779F9)
comptime _PRIME64_4 = UInt64(0x85EBCA77C2B2AE63)
comptime _PRIME64_5 = UInt64(0x27D4EB2F165667C5)
comptime _PRIME_MX1 = UInt64(0x165667919E3779F9)
comptime _PRIME_MX2 = UInt64(0x9FB21C651E98DF25)

comptime _SECRET_BYTES = 192
comptime _SECRET = SIMD[DType.uint64, 32](
    0xBE4BA423396CFEB8, 0x1CAD21F72C81017C, 0xDB979083E96DD4DE, 0x1F67B3B7A4A44072,
    0x78E5C0CC4EE679CB, 0x2172FFCC7DD05A82, 0x8E2443F7744608B8, 0x4C263A81E69035E0,
    0xCB00C391BB52283C, 0xA32E531B8B65D088, 0x4EF90DA297486471, 0xD8ACDEA946EF1938,
    0x3F349CE33F76FAA8, 0x1D4F0BC7C7BBDCF9, 0x3159B4CD4BE0518A, 0x647378D9C97E9FC8,
    0xC3EBD33483ACC5EA, 0xEB6313FAFFA081C5, 0x49DAF0B751DD0D17, 0x9E68D429265516D3,
    0xFCA1477D58BE162B, 0xCE31D07AD1B8F88F, 0x280416958F3ACB45, 0x7E404BBBCAFBD7AF,
    0, 0, 0, 0, 0, 0, 0, 0,
)
"""XXH3's default secret (the specification's 192 bytes, as little-endian 64-bit words),
padded to a power-of-two width."""

comptime _ODD_WORDS = (iota[DType.uint64, 32]() & 1).eq(1)
"""The secret words that a seed is subtracted from (it is added to the others)."""

comptime _STRIPE = 64
comptime _STRIPES_PER_BLOCK = (_SECRET_BYTES - _STRIPE) // 8
"""16: each stripe reads the secret 8 bytes further on, until the secret runs out."""
comptime _BLOCK = _STRIPE * _STRIPES_PER_BLOCK


@always_inline
def _secret64[offset: Int]() -> UInt64:
    """The default secret's 8 bytes at byte `offset`, little-endian (folded at compile time)."""
    comptime word = bitcast[DType.uint64, 1](
        bitcast[DType.uint8, 256](_SECRET).slice[8, offset=offset]()
    )
    return word


@always_inline
def _read64(p: U8Ptr, offset: Int) -> UInt64:
    return p.unsafe_offset(offset).unsafe_bitcast[UInt64]().unsafe_load[alignment=1](0)


@always_inline
def _read32(p: U8Ptr, offset: Int) -> UInt64:
    return UInt64(p.unsafe_offset(offset).unsafe_bitcast[UInt32]().unsafe_load[alignment=1](0))


@always_inline
def _read_lanes(p: U8Ptr, offset: Int) -> Lanes:
    return p.unsafe_offset(offset).unsafe_bitcast[UInt64]().unsafe_load[width=8, alignment=1](0)


@always_inline
def _mul_fold(a: UInt64, b: UInt64) -> UInt64:
    """The 128-bit product of `a` and `b`, its halves xored."""
    var product = a.cast[DType.uint128]() * b.cast[DType.uint128]()
    return (product ^ (product >> 64)).cast[DType.uint64]()


@always_inline
def _avalanche(var h: UInt64) -> UInt64:
    h ^= h >> 37
    h *= _PRIME_MX1
    return h ^ (h >> 32)


@always_inline
def _mix16[secret_offset: Int](input: U8Ptr, offset: Int, seed: UInt64) -> UInt64:
    """16 input bytes at `offset` against the seeded default secret at `secret_offset`."""
    return _mul_fold(
        _read64(input, offset) ^ (_secret64[secret_offset]() + seed),
        _read64(input, offset + 8) ^ (_secret64[secret_offset + 8]() - seed),
    )


def _xxh3_4to8(input: U8Ptr, length: Int, seed: UInt64) -> UInt64:
    var s = seed ^ (UInt64(byte_swap(seed.cast[DType.uint32]())) << 32)
    var bitflip = (_secret64[8]() ^ _secret64[16]()) - s
    var h = ((_read32(input, 0) << 32) + _read32(input, length - 4)) ^ bitflip
    h ^= rotate_bits_left[49](h) ^ rotate_bits_left[24](h)
    h *= _PRIME_MX2
    h ^= (h >> 35) + UInt64(length)
    h *= _PRIME_MX2
    return h ^ (h >> 28)


def _xxh3_9to16(input: U8Ptr, length: Int, seed: UInt64) -> UInt64:
    var lo = _read64(input, 0) ^ ((_secret64[24]() ^ _secret64[32]()) + seed)
    var hi = _read64(input, length - 8) ^ ((_secret64[40]() ^ _secret64[48]()) - seed)
    return _avalanche(UInt64(length) + byte_swap(lo) + hi + _mul_fold(lo, hi))


def _xxh3_17to128(input: U8Ptr, length: Int, seed: UInt64) -> UInt64:
    """Round r mixes the 16 bytes r*16 from the start and those r*16 before the end;
    rounds 1-3 only for inputs over 32, 64 and 96 bytes."""
    var acc = UInt64(length) * _PRIME64_1
    comptime for r in range(4):
        if length > 32 * r:
            acc += _mix16[32 * r](input, 16 * r, seed)
            acc += _mix16[32 * r + 16](input, length - 16 * (r + 1), seed)
    return _avalanche(acc)


def _xxh3_129to240(input: U8Ptr, length: Int, seed: UInt64) -> UInt64:
    """The first 128 bytes, avalanched; then the other whole 16-byte rounds (at most 7 at
    240 bytes) against the secret from byte 3 on, and the last 16 bytes."""
    var acc = UInt64(length) * _PRIME64_1
    comptime for r in range(8):
        acc += _mix16[16 * r](input, 16 * r, seed)
    acc = _avalanche(acc)
    comptime for r in range(8, 15):
        if r < length // 16:
            acc += _mix16[16 * (r - 8) + 3](input, 16 * r, seed)
    acc += _mix16[136 - 17](input, length - 16, seed)
    return _avalanche(acc)


@always_inline
def _accumulate_stripe(mut acc: Lanes, input: U8Ptr, offset: Int, secret: U8Ptr, key_offset: Int):
    """One 64-byte stripe into the accumulators, keyed by the secret at `key_offset`."""
    var data = _read_lanes(input, offset)
    var keyed = data ^ _read_lanes(secret, key_offset)
    acc += data.shuffle[1, 0, 3, 2, 5, 4, 7, 6]()  # each lane also adds its neighbour's data
    acc += (keyed & 0xFFFFFFFF) * (keyed >> 32)  # 32 x 32 -> 64-bit products (vpmuludq)


def _xxh3_long(input: U8Ptr, length: Int, secret: U8Ptr) -> UInt64:
    """Inputs over 240 bytes, with the secret already seeded: blocks of 16 stripes, each
    block followed by a scramble; the stripes left over; the input's last 64 bytes; then
    the accumulators merged into one word."""
    var acc = Lanes(
        _PRIME32_3, _PRIME64_1, _PRIME64_2, _PRIME64_3,
        _PRIME64_4, _PRIME32_2, _PRIME64_5, _PRIME32_1,
    )
    var blocks = (length - 1) // _BLOCK
    var scramble_key = _read_lanes(secret, _SECRET_BYTES - _STRIPE)
    for b in range(blocks):
        comptime for s in range(_STRIPES_PER_BLOCK):
            _accumulate_stripe(acc, input, b * _BLOCK + s * _STRIPE, secret, 8 * s)
        acc = ((acc ^ (acc >> 47)) ^ scramble_key) * _PRIME32_1
    for s in range((length - 1 - blocks * _BLOCK) // _STRIPE):
        _accumulate_stripe(acc, input, blocks * _BLOCK + s * _STRIPE, secret, 8 * s)
    _accumulate_stripe(acc, input, length - _STRIPE, secret, _SECRET_BYTES - _STRIPE - 7)
    var h = UInt64(length) * _PRIME64_1
    comptime for i in range(4):  # accumulator pairs against the secret from byte 11 on
        var key = 11 + 16 * i
        h += _mul_fold(acc[2 * i] ^ _read64(secret, key), acc[2 * i + 1] ^ _read64(secret, key + 8))
    return _avalanche(h)


@always_inline
def _xxh3_64(input: U8Ptr, length: Int, seed: UInt64, secret: U8Ptr) -> UInt64:
    """XXH3-64 of `length` (a multiple of 8, at least 8) bytes at `input`, seeded; `secret`:
    192 bytes of scratch for the seeded secret of a long input."""
    if length <= 16:
        if length > 8:
            return _xxh3_9to16(input, length, seed)
        return _xxh3_4to8(input, length, seed)
    if length <= 128:
        return _xxh3_17to128(input, length, seed)
    if length <= 240:
        return _xxh3_129to240(input, length, seed)
    var seeds = _ODD_WORDS.select(SIMD[DType.uint64, 32](0 - seed), SIMD[DType.uint64, 32](seed))
    secret.unsafe_bitcast[UInt64]().unsafe_store(0, _SECRET + seeds)
    return _xxh3_long(input, length, secret)


def chain_xxh3(
    tokens_address: PythonObject,
    num_pages: PythonObject,
    page_bytes: PythonObject,
    parent_bits: PythonObject,
    out_address: PythonObject,
) raises -> PythonObject:
    """Writes the chained XXH3-64 hashes of `num_pages` consecutive pages to `out_address`:
    page i's hash is XXH3-64 of its bytes seeded with page i-1's hash (or the parent).

    Arguments as `chain_sha256`'s; `page_bytes` must be a positive multiple of 8."""
    var src = U8Ptr(unsafe_from_address=Int(py=tokens_address))
    var out = U64Ptr(unsafe_from_address=Int(py=out_address))
    var n = Int(py=num_pages)
    var size = Int(py=page_bytes)
    var parent = Scalar[DType.int64](Int(py=parent_bits)).cast[DType.uint64]()
    if n < 0 or size < 8 or size % 8 != 0:
        raise Error(t"ValueError: num_pages={n} must be >= 0, page_bytes={size} 8, 16, 24, ...")
    var scratch = List[UInt64](length=32, fill=0)
    var secret = U8Ptr(unsafe_from_address=Int(scratch.unsafe_ptr()))
    for i in range(n):
        parent = _xxh3_64(src.unsafe_offset(i * size), size, parent, secret)
        out.unsafe_store(i, parent)
    _ = scratch^
    return PythonObject(None)


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
        b.def_function[chain_xxh3](
            "chain_xxh3",
            docstring="chain_xxh3(tokens_address, num_pages, page_bytes, parent_bits, out_address)",
        )
        return b.finalize()
    except e:
        abort(t"failed to build mokv_hash_ext: {e}")
