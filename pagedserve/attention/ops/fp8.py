"""fp8 e4m3 conversion inside Triton kernels, bit-exact with torch's cast on the GPU and in
the interpreter (whose own fp8 cast mis-rounds a mantissa carry: 1.9988 became 1.0)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp32_to_e4m3_bits(x):
    """fp8 e4m3 bit patterns of fp32 x (round to nearest even, saturating at 448), in integer
    arithmetic: the same on the GPU and in the interpreter, whose fp8 cast mis-rounds carries."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 128
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23  # fp32 biased exponent; e4m3 normals need exp >= 127 - 6
    # Normal: keep 3 mantissa bits, rounding to even; a carry moves into the exponent by itself.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal (m * 2^-9): the significand shifted right by 20 + (121 - exp), rounded to even;
    # below 2^-10 everything rounds to zero.
    shift = tl.maximum(tl.minimum(20 + 121 - exp, 31), 1)  # clamped: unused outside 20..24
    full = (mag & 0x7FFFFF) | 0x800000
    sub = (full + ((1 << (shift - 1)) - 1) + ((full >> shift) & 1)) >> shift
    sub = tl.where(exp < 117, 0, sub)
    return sign | tl.minimum(tl.where(exp >= 121, normal, sub), 126)
