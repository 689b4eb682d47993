"""The order in which a GEMM's programs walk its output tiles, and the K tiles a split-K program
walks, shared by the quantized GEMMs."""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """Program `pid`'s output tile (row tile, column tile). GROUP_M row tiles walk the column
    tiles together, so the weight tiles they share stay in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def k_slice(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [first, last) of this program's slice (program_id(1) of SPLIT_K)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = tl.program_id(1) * per_split
    return first, tl.minimum(first + per_split, k_tiles)
