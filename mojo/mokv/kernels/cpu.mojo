"""What the build target's CPU gives the CPU kernels, in one place.

The kernels are written once over `W` float32 lanes and `VECTOR_REGISTERS` registers,
and take a path by feature, never by a CPU's name:

  * AVX-512F: 16 lanes, 32 registers, and `vscalefps` for the softmax's `exp2`.
  * AVX-512 BF16 (with AVX-512F): `vdpbf16ps` for bf16 dot products.
  * Anything else MAX runs on a CPU (x86-64 with AVX2, Arm): the portable paths,
    8 lanes and a register budget of 16, an `exp2` whose power of two is built with
    integer ops, bf16 widened to f32 by a shift. LLVM maps 8-lane vectors onto one AVX2
    register or two NEON ones; nothing here names an x86 intrinsic outside a branch
    that the feature test guards.

`MOKV_CPU_PORTABLE=true`, a compile-time define, forces the portable paths whatever
the target has (`mojo run -D MOKV_CPU_PORTABLE=true ...`, or
`with mokv.ops.portable_cpu_paths(session):` around graph compiles): the suite runs
the kernel tests both ways, so CI on an AVX-512 host covers the paths of an AVX2 host.

The tuning table: where CPUs with the same features differ in speed and a measured
choice pays, it is a fact below, named by LLVM CPU, with the generic answer for every
CPU not listed. A kernel reads the fact, never the CPU's name.
"""

from std.sys.defines import get_defined_bool
from std.sys.info import CompilationTarget

comptime PORTABLE = get_defined_bool["MOKV_CPU_PORTABLE", False]()
"""Whether the build was asked for the portable paths (see the module docstring)."""
comptime HAS_AVX512F = not PORTABLE and CompilationTarget._has_feature["avx512f"]()
"""Whether the kernels use AVX-512F: 16-lane vectors, 32 registers, `vscalefps`."""
comptime HAS_AVX512_BF16 = HAS_AVX512F and CompilationTarget._has_feature["avx512bf16"]()
"""Whether the kernels use `vdpbf16ps` for bf16 dot products."""
comptime W = 16 if HAS_AVX512F else 8
"""Float32 lanes of the kernels' vectors: one AVX-512 register, or the portable 8."""
comptime VECTOR_REGISTERS = 32 if HAS_AVX512F else 16
"""Vector registers a register block may plan for (AVX2 has 16, NEON 32 of half the
width, so 16 of 8 lanes)."""

# ---------------------------------------------------------------- the tuning table

comptime SPLIT_512_UNITS = HAS_AVX512F and CompilationTarget._is_arch["znver4"]()
"""Zen 4 runs each 512-bit op as two 256-bit halves, so 8-lane vectors cost it no
peak (117 GFLOP/s per core for f32 FMAs in 8 or 16 lanes, register-only loops) and
can be the faster form (`attention.forms.NARROW_LANES`). Generic: whole 512-bit units
(Intel since Skylake-SP, Zen 5: 16 lanes at twice the rate of 8, 175 vs 95 GFLOP/s on
an emeraldrapids core)."""
comptime HALF_RATE_BF16_DOT = HAS_AVX512_BF16 and (
    CompilationTarget._is_arch["sapphirerapids"]() or CompilationTarget._is_arch["emeraldrapids"]()
)
"""Intel's server cores run `vdpbf16ps` at half the rate of an f32 FMA (emeraldrapids,
register-only loops, 16 lanes: 86 vs 175 GFLOP/s per core), so bf16 decode there
widens K and V to f32 instead (`attention.forms`). Generic: full rate (Zen 4 and
Zen 5 run both at one 512-bit op per cycle)."""
