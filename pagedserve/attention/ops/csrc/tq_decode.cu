// TurboQuant paged decode attention for NVIDIA GPUs (sm_80+; fp8 keys need sm_89+).
//
// One CTA of 4 warps per (decode request, KV head[, split]); head size D = 64 or 128. The query
// heads of the KV group (up to 16) are rotated once in shared memory (fast Walsh-Hadamard
// transform), then each warp walks every fourth 16-key tile of the (split's) cached context and
// computes, with m16n8k16 tensor-core products,
//     S^T [16 keys x 8 heads]  = K [16 keys x D] . Q^T             (keys as the A operand)
//     O^T [D x 8 heads]       += V^T [D x 16 keys] . P^T            (values as the A operand)
// so that the dequantized keys and values go straight from the loaded codes into A-operand
// registers: no shared-memory staging and no layout conversion. Which physical channels a
// lane holds is a free choice (a dot product does not depend on the order of its terms), so
// every lane reads whole contiguous runs of a code row:
//   keys:   lane (g = lane / 4, t = lane % 4) holds channels [D/4 t, D/4 (t + 1)) of keys g and
//           g + 8; mma k-step ks, k positions 2t + {0, 1} and 2t + 8 + {0, 1} are channels
//           D/4 t + 4ks + {0, 1} and D/4 t + 4ks + {2, 3}; the query's B operand uses the
//           same map.
//   values: lane holds channels [D/8 g, D/8 (g + 1)) of keys 2t, 2t + 1, 2t + 8, 2t + 9; m-tile
//           mt rows g and g + 8 are channels D/8 g + 2mt and D/8 g + 2mt + 1 (one code pair).
// Codes become fp16 by one shared-memory load per channel pair from a 2^(2 bits)-entry table
// of level pairs, replicated per lane so that a warp's lookups never conflict (4 bits: 256
// entries = 32 KB; 3 bits: 64 entries), and fp8 keys by one cvt per pair. The per-vector
// scales multiply the scores (keys) and the probabilities (values), never the codes. P goes
// from the S^T accumulator to the B operand of the PV product by movmatrix (an 8x8 transpose
// in registers). Online softmax in base 2, fp32; a warp rescales its accumulator only when a
// tile raises some head's maximum. The four warps merge through shared memory, add the step's
// new token at full precision (rotated in shared memory), rotate the result back and store it,
// or, split-KV, store the split's (max, sum, unnormalised output) for reduce_split_kv.
//
// The format is ops/turboquant_format.py: per (block, KV head) a region of
//   [K code rows][V code rows][K fp16 norms][V fp16 norms]
// with channel c of a b-bit row at bits [c b, (c + 1) b) little-endian, stored vectors
// y = norm / sqrt(d) * level[code] (fp8 keys: norm / sqrt(d) * e4m3(code)).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

// The launch parameters; tq_decode_cuda._Params mirrors this layout (checked by size).
struct TQDecodeParams {
  const void* query;  // [T, H, 128]
  const void* key;    // [T, Hkv, 128]: the step's new keys (full precision)
  const void* value;
  void* out;          // [T, H, 128]
  const uint8_t* cache;  // [blocks, Hkv, block_size, slot_bytes]
  const int32_t* block_table;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* qblock_req;   // program -> request
  const float* signs;          // [128] the rotation's +-1 diagonal
  const uint32_t* pair_table;  // fp16 level pairs: entry e = (level[e & m], level[e >> b])
  // Split-KV (num_splits > 1): per (token, head, split) the base-2 max and the sum of weights,
  // and the unnormalised output rotated back [..., 128] (decode_split_kv's partials layout).
  float* part_m;
  float* part_l;
  float* part_acc;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h;
  int64_t o_stride_t, o_stride_h;  // in elements; the channel stride is 1
  int64_t cache_stride_block, cache_stride_head;  // bytes
  int64_t block_table_stride;
  int block_size_log2;
  int v_codes_offset, k_meta_offset, v_meta_offset;  // bytes inside a (block, KV head) region
  int queries_per_kv;
  int head_size;  // 64 or 128
  int num_splits;
  float scale;
};

namespace {

using Params = TQDecodeParams;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t r;
  asm("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo; }"
      : "=r"(r) : "r"(two_bytes));
  return r;
#else
  __trap();  // the host only picks fp8 keys on sm_89+
  return 0;
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: 2^-inf = 0
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ float warp_max_over_rows(float x) {  // over lanes of one t
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

__device__ __forceinline__ float warp_sum_over_rows(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// Byte offset into the lane-replicated pair table (entry e at e * 128 + 4 lane) of the
// 2 * BITS-bit code pair starting at bit `bit` of a little-endian run of N words: one funnel
// shift and one AND.
template <int N, int BITS>
__device__ __forceinline__ uint32_t entry_offset(const uint32_t (&w)[N], int bit) {
  constexpr uint32_t kMask = ((1u << (2 * BITS)) - 1) << 7;
  const int s = bit - 7;
  if (s < 0) return (w[0] << -s) & kMask;
  const int word = s >> 5;
  const uint32_t hi = word + 1 < N ? w[word + 1] : 0u;
  return __funnelshift_r(w[word], hi, s & 31) & kMask;
}

__device__ __forceinline__ uint32_t lookup(const char* table, uint32_t offset, uint32_t lane4) {
  return *reinterpret_cast<const uint32_t*>(table + (offset | lane4));
}

// Loads a lane's run of NBYTES code bytes at p into words, byte 0 in the low bits. ALIGN is
// what is known of p's alignment: 16, 8 and 4 use vector or word loads; 0 (a run that starts
// inside a word) loads the covering words and shifts them down.
template <int NBYTES, int ALIGN>
__device__ __forceinline__ void load_run(const uint8_t* p, uint32_t (&out)[(NBYTES + 3) / 4]) {
  constexpr int kWords = (NBYTES + 3) / 4;
  if constexpr (ALIGN >= 16 && NBYTES % 16 == 0) {
    #pragma unroll
    for (int i = 0; i < NBYTES / 16; ++i) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p) + i);
      out[4 * i] = q.x;
      out[4 * i + 1] = q.y;
      out[4 * i + 2] = q.z;
      out[4 * i + 3] = q.w;
    }
  } else if constexpr (ALIGN >= 8 && NBYTES % 8 == 0) {
    #pragma unroll
    for (int i = 0; i < NBYTES / 8; ++i) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(p) + i);
      out[2 * i] = q.x;
      out[2 * i + 1] = q.y;
    }
  } else if constexpr (ALIGN >= 4 && NBYTES % 4 == 0) {
    #pragma unroll
    for (int i = 0; i < kWords; ++i) out[i] = __ldg(reinterpret_cast<const uint32_t*>(p) + i);
  } else {
    const uintptr_t address = reinterpret_cast<uintptr_t>(p);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(address & ~uintptr_t{3});
    const uint32_t shift = static_cast<uint32_t>(address & 3) * 8;
    uint32_t words[kWords + 1];
    #pragma unroll
    for (int i = 0; i <= kWords; ++i) words[i] = __ldg(w + i);
    #pragma unroll
    for (int i = 0; i < kWords; ++i) out[i] = __funnelshift_r(words[i], words[i + 1], shift);
  }
}

// One 16-key tile as a lane holds it. D: head size (64 or 128); code bits per key / value
// channel: 8 (fp8 e4m3, keys only), 4 or 3 (Lloyd-Max).
template <int D, int KBITS, int VBITS>
struct Tile {
  static constexpr int kKeyRowBytes = KBITS * D / 8;
  static constexpr int kValueRowBytes = VBITS * D / 8;
  static constexpr int kKeyRun = kKeyRowBytes / 4;    // bytes of a lane's D/4 key channels
  static constexpr int kValueRun = kValueRowBytes / 8;  // bytes of its D/8 value channels
  static constexpr int kKeyWords = (kKeyRun + 3) / 4;
  static constexpr int kValueWords = (kValueRun + 3) / 4;
  // Alignment of a lane's run: rows start 8-byte aligned (plane offsets are multiples of
  // 16 rows, code rows multiples of 8 bytes), runs at multiples of their length.
  __host__ __device__ static constexpr int align_of(int run) {
    return run % 16 == 0 ? 16 : run % 8 == 0 ? 8 : run % 4 == 0 ? 4 : 0;
  }
  uint32_t k[2][kKeyWords];    // keys g and g + 8: channels [D/4 t, D/4 (t + 1))
  uint32_t v[4][kValueWords];  // keys 2t, 2t + 1, 2t + 8, 2t + 9: channels [D/8 g, D/8 (g + 1))
  uint32_t norms;              // fp16 key norms of keys g (low) and g + 8 (high)
  uint32_t vnorms;

  // Per-lane byte offsets of the rows a lane reads, relative to a tile's first row.
  struct Lane {
    int key, value, meta;
    __device__ Lane(int g, int t)
        : key(g * kKeyRowBytes + t * kKeyRun), value(2 * t * kValueRowBytes + g * kValueRun),
          meta(2 * g) {}
  };

  __device__ __forceinline__ void load(const uint8_t* region, int row0, const Params& p,
                                       const Lane& lane) {
    const uint8_t* kr = region + row0 * kKeyRowBytes + lane.key;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      load_run<kKeyRun, align_of(kKeyRun)>(kr + r * 8 * kKeyRowBytes, k[r]);
    }
    const uint8_t* vr = region + p.v_codes_offset + row0 * kValueRowBytes + lane.value;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {  // keys 2t, 2t + 1, 2t + 8, 2t + 9
      load_run<kValueRun, align_of(kValueRun)>(vr + ((i & 1) + 8 * (i >> 1)) * kValueRowBytes,
                                                v[i]);
    }
    const uint8_t* km = region + p.k_meta_offset + row0 * 2 + lane.meta;
    const uint8_t* vm = region + p.v_meta_offset + row0 * 2 + lane.meta;
    norms = static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(km))) |
            (static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(km + 16))) << 16);
    vnorms = static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(vm))) |
             (static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(vm + 16))) << 16);
  }

  // A operand of k-step ks for keys g / g + 8: registers (row g, k 2t..), (row g + 8, k 2t..),
  // (row g, k 2t + 8..), (row g + 8, k 2t + 8..) = channels D/4 t + 4ks + {0,1} and {2,3},
  // i.e. code pairs 2ks and 2ks + 1 of the lane's run.
  __device__ __forceinline__ void key_operand(int ks, const char* table, uint32_t lane4,
                                              uint32_t (&a)[4]) const {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (KBITS == 8) {
        a[r] = e4m3x2_to_f16x2(k[r][ks] & 0xffffu);
        a[r + 2] = e4m3x2_to_f16x2(k[r][ks] >> 16);
      } else {
        a[r] = lookup(table, entry_offset<kKeyWords, KBITS>(k[r], 4 * KBITS * ks), lane4);
        a[r + 2] = lookup(table, entry_offset<kKeyWords, KBITS>(k[r], 4 * KBITS * ks + 2 * KBITS),
                          lane4);
      }
    }
  }

  // V^T A operand of m-tile mt: rows channels D/8 g + 2mt (+ 1), columns keys 2t, 2t + 1
  // (a0, a1) and 2t + 8, 2t + 9 (a2, a3): one level pair per key, halves regrouped by prmt.
  __device__ __forceinline__ void value_operand(int mt, const char* table, uint32_t lane4,
                                                uint32_t (&a)[4]) const {
    uint32_t l[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      l[i] = lookup(table, entry_offset<kValueWords, VBITS>(v[i], 2 * VBITS * mt), lane4);
    }
    a[0] = prmt(l[0], l[1], 0x5410);
    a[1] = prmt(l[0], l[1], 0x7632);
    a[2] = prmt(l[2], l[3], 0x5410);
    a[3] = prmt(l[2], l[3], 0x7632);
  }
};

template <typename T, int D, int KBITS, int VBITS, int NT>
__global__ void __launch_bounds__(kThreads, NT == 1 ? 4 : 2) tq_decode_kernel(const Params p) {
  constexpr int kHead = D;
  constexpr int kSteps = D / 16;  // k-steps of S^T = K Q^T, m-tiles of O^T = V^T P^T
  constexpr int kHeads = NT * 8;  // query heads padded to whole n-tiles of 8
  constexpr int kTableEntries = VBITS == 4 ? 256 : 64;
  constexpr int kTableWords = kTableEntries * 32;
  constexpr int kMergeWords = kWarps * kHeads * kHead;
  constexpr int kSharedWords = kTableWords > kMergeWords ? kTableWords : kMergeWords;
  __shared__ uint32_t shared[kSharedWords];  // the lookup table, then the warps' accumulators
  __shared__ float qs[kHeads][kHead];       // rotated, scaled queries; later the outputs
  __shared__ float new_kv[2][kHead];        // the new token's rotated key and value
  __shared__ float new_score[kHeads];
  __shared__ float warp_m[kWarps][kHeads], warp_l[kWarps][kHeads];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int kv_head = blockIdx.y;
  const int req = p.qblock_req[blockIdx.x];
  const int token = p.query_start_loc[req];
  const int context = p.seq_lens[req] - (p.query_start_loc[req + 1] - token);
  const int qpk = p.queries_per_kv;
  // This split's whole 16-key tiles; the last split also takes the new token.
  const int num_context_tiles = (context + 15) >> 4;
  const int tiles_per_split = (num_context_tiles + p.num_splits - 1) / p.num_splits;
  const int split = blockIdx.z;
  const int tile_lo = split * tiles_per_split;
  const int tile_end = min(tile_lo + tiles_per_split, num_context_tiles);
  const bool last_split = split == p.num_splits - 1;

  for (int i = tid; i < kTableWords; i += kThreads) shared[i] = p.pair_table[i >> 5];

  // Rotate the queries and the new key / value: y = H (D x) / sqrt(d), H by an in-place FWHT.
  const T* q = static_cast<const T*>(p.query) + token * p.q_stride_t;
  for (int i = tid; i < kHeads * kHead; i += kThreads) {
    const int h = i / kHead, c = i % kHead;
    qs[h][c] = h < qpk ? to_float(q[(kv_head * qpk + h) * p.q_stride_h + c]) * p.signs[c] : 0.f;
  }
  if (tid < kHead) {
    const T* kn = static_cast<const T*>(p.key) + token * p.k_stride_t + kv_head * p.k_stride_h;
    const T* vn = static_cast<const T*>(p.value) + token * p.v_stride_t + kv_head * p.v_stride_h;
    new_kv[0][tid] = to_float(kn[tid]) * p.signs[tid];
    new_kv[1][tid] = to_float(vn[tid]) * p.signs[tid];
  }
  __syncthreads();
  for (int h = 1; h < kHead; h <<= 1) {
    for (int i = tid; i < (kHeads + 2) * (kHead / 2); i += kThreads) {
      const int vec = i / (kHead / 2), pair = i % (kHead / 2);
      const int lo = (pair / h) * 2 * h + pair % h;
      float* x = vec < kHeads ? qs[vec] : new_kv[vec - kHeads];
      const float a = x[lo], b = x[lo + h];
      x[lo] = a + b;
      x[lo + h] = a - b;
    }
    __syncthreads();
  }
  const float inv_sqrt_d = rsqrtf(static_cast<float>(kHead));
  const float q_factor = p.scale * kLog2e * inv_sqrt_d;  // scores in base 2
  for (int i = tid; i < kHeads * kHead; i += kThreads) qs[i / kHead][i % kHead] *= q_factor;
  if (tid < kHead) {
    new_kv[0][tid] *= inv_sqrt_d;
    new_kv[1][tid] *= inv_sqrt_d;
  }
  __syncthreads();
  for (int h = warp; h < kHeads; h += kWarps) {
    float s = 0.f;
    #pragma unroll
    for (int c = lane; c < kHead; c += 32) s += qs[h][c] * new_kv[0][c];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) new_score[h] = s;
  }

  // The query's B operands: n-tile nt, head row g, k-step ks: channels D/4 t + 4ks + {0,1},
  // {2,3}.
  uint32_t qb[NT][kSteps][2];
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    #pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      const float* row = qs[nt * 8 + g] + kHead / 4 * t + 4 * ks;
      qb[nt][ks][0] = pack_f16x2(row[0], row[1]);
      qb[nt][ks][1] = pack_f16x2(row[2], row[3]);
    }
  }

  float acc[kSteps][NT][4];
  float m_run[NT][2], l_part[NT][2];
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    m_run[nt][0] = m_run[nt][1] = -INFINITY;
    l_part[nt][0] = l_part[nt][1] = 0.f;
    #pragma unroll
    for (int mt = 0; mt < kSteps; ++mt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  }

  // This lane's copy of table entry e is at byte e * 128 + 4 lane (no bank conflicts).
  const char* table = reinterpret_cast<const char*>(shared);
  const uint32_t lane4 = static_cast<uint32_t>(lane) << 2;
  const uint8_t* head_base = p.cache + kv_head * p.cache_stride_head;
  const int32_t* pages = p.block_table + req * p.block_table_stride;
  const int block_mask = (1 << p.block_size_log2) - 1;
  auto region_of = [&](int page) { return head_base + static_cast<int64_t>(page) * p.cache_stride_block; };

  using TileT = Tile<D, KBITS, VBITS>;
  const typename TileT::Lane lane_offsets(g, t);
  // One 16-key tile: load the tile kWarps ahead into `ahead` (its page was read a round
  // earlier), then score and accumulate `tile`.
  auto process = [&](TileT& cur, TileT& ahead, int tile, int& next_page) {
    const int next = tile + kWarps;
    if (next < tile_end) {
      ahead.load(region_of(next_page), (next * 16) & block_mask, p, lane_offsets);
      if (next + kWarps < tile_end) next_page = __ldg(pages + (((next + kWarps) * 16) >> p.block_size_log2));
    }
    // Scores S^T: rows keys g / g + 8, columns heads 2t, 2t + 1 of each n-tile.
    float s[NT][4];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    #pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      uint32_t a[4];
      cur.key_operand(ks, table, lane4, a);
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_16816(s[nt], a[0], a[1], a[2], a[3], qb[nt][ks][0], qb[nt][ks][1]);
    }
    const int key0 = tile * 16 + g;
    const bool ok0 = key0 < context, ok1 = key0 + 8 < context;
    const __half2 kn2 = *reinterpret_cast<const __half2*>(&cur.norms);
    const __half2 vn2 = *reinterpret_cast<const __half2*>(&cur.vnorms);
    const float ks0 = __low2float(kn2) * inv_sqrt_d, ks1 = __high2float(kn2) * inv_sqrt_d;
    // Rows past the context hold whatever the page holds: their scores become -inf and their
    // value scales 0 (never 0 * garbage).
    const float vs0 = ok0 ? __low2float(vn2) * inv_sqrt_d : 0.f;
    const float vs1 = ok1 ? __high2float(vn2) * inv_sqrt_d : 0.f;
    bool raise = false;
    float tile_max[NT][2];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = ok0 ? s[nt][0] * ks0 : -INFINITY;
      s[nt][1] = ok0 ? s[nt][1] * ks0 : -INFINITY;
      s[nt][2] = ok1 ? s[nt][2] * ks1 : -INFINITY;
      s[nt][3] = ok1 ? s[nt][3] * ks1 : -INFINITY;
      #pragma unroll
      for (int j = 0; j < 2; ++j) {
        tile_max[nt][j] = warp_max_over_rows(fmaxf(s[nt][j], s[nt][j + 2]));
        raise |= tile_max[nt][j] > m_run[nt][j];
      }
    }
    if (__any_sync(0xffffffffu, raise)) {  // warp-uniform: most tiles skip the rescale
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float m_new = fmaxf(m_run[nt][j], tile_max[nt][j]);
          const float alpha = fast_exp2(m_run[nt][j] - m_new);
          m_run[nt][j] = m_new;
          l_part[nt][j] *= alpha;
          #pragma unroll
          for (int mt = 0; mt < kSteps; ++mt) {
            acc[mt][nt][j] *= alpha;
            acc[mt][nt][j + 2] *= alpha;
          }
        }
      }
    }
    // P^T as the B operand: P (rows keys, columns heads) times the value scales, transposed.
    uint32_t pb[NT][2];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float p0 = fast_exp2(s[nt][0] - m_run[nt][0]), p1 = fast_exp2(s[nt][1] - m_run[nt][1]);
      const float p2 = fast_exp2(s[nt][2] - m_run[nt][0]), p3 = fast_exp2(s[nt][3] - m_run[nt][1]);
      l_part[nt][0] += p0 + p2;
      l_part[nt][1] += p1 + p3;
      pb[nt][0] = transpose_8x8(pack_f16x2(p0 * vs0, p1 * vs0));
      pb[nt][1] = transpose_8x8(pack_f16x2(p2 * vs1, p3 * vs1));
    }
    #pragma unroll
    for (int mt = 0; mt < kSteps; ++mt) {
      uint32_t a[4];
      cur.value_operand(mt, table, lane4, a);
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_16816(acc[mt][nt], a[0], a[1], a[2], a[3], pb[nt][0], pb[nt][1]);
    }
  };

  TileT tile_a, tile_b;
  int tile = tile_lo + warp;
  int next_page = tile + kWarps < tile_end ? __ldg(pages + (((tile + kWarps) * 16) >> p.block_size_log2)) : 0;
  if (tile < tile_end) {
    const int page = __ldg(pages + ((tile * 16) >> p.block_size_log2));
    tile_a.load(region_of(page), (tile * 16) & block_mask, p, lane_offsets);
  }
  __syncthreads();  // the table
  // Unrolled by two so that the prefetched tile needs no register copies.
  for (; tile < tile_end; tile += 2 * kWarps) {
    process(tile_a, tile_b, tile, next_page);
    if (tile + kWarps >= tile_end) break;
    process(tile_b, tile_a, tile + kWarps, next_page);
  }

  // Merge the warps: each writes its (m, l, acc) per head, rows of channels.
  __syncthreads();  // done with the table
  float* merge = reinterpret_cast<float*>(shared);  // [warp][head][channel]
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    #pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float l = warp_sum_over_rows(l_part[nt][j]);
      const int h = nt * 8 + 2 * t + j;
      if (g == 0) {
        warp_m[warp][h] = m_run[nt][j];
        warp_l[warp][h] = l;
      }
      #pragma unroll
      for (int mt = 0; mt < kSteps; ++mt) {
        const int c = kHead / 8 * g + 2 * mt;
        merge[(warp * kHeads + h) * kHead + c] = acc[mt][nt][j];
        merge[(warp * kHeads + h) * kHead + c + 1] = acc[mt][nt][j + 2];
      }
    }
  }
  __syncthreads();
  const int c = tid;  // one channel per thread
  const bool split_kv = p.num_splits > 1;
  const int64_t part_row0 = (static_cast<int64_t>(token) * gridDim.y * qpk + kv_head * qpk) *
                            p.num_splits + split;
  for (int h = 0; h < qpk && c < kHead; ++h) {
    const float s_new = last_split ? new_score[h] : -INFINITY;
    float m = s_new;
    #pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_m[w][h]);
    const float base = m == -INFINITY ? 0.f : m;  // an empty split: every weight 0
    const float e_new = fast_exp2(s_new - base);
    float l = e_new, o = e_new * new_kv[1][c];
    #pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float e = fast_exp2(warp_m[w][h] - base);  // 0 for a warp that had no tile
      l += warp_l[w][h] * e;
      o += merge[(w * kHeads + h) * kHead + c] * e;
    }
    if (split_kv) {
      qs[h][c] = o;  // merged and normalised by decode_split_kv.reduce_split_kv
      if (c == 0) {
        p.part_m[part_row0 + h * p.num_splits] = m;
        p.part_l[part_row0 + h * p.num_splits] = l;
      }
    } else {
      qs[h][c] = o / l;
    }
  }
  __syncthreads();
  // Rotate back: x = D H y / sqrt(d).
  for (int h = 1; h < kHead; h <<= 1) {
    for (int i = tid; i < qpk * (kHead / 2); i += kThreads) {
      const int vec = i / (kHead / 2), pair = i % (kHead / 2);
      const int lo = (pair / h) * 2 * h + pair % h;
      const float a = qs[vec][lo], b = qs[vec][lo + h];
      qs[vec][lo] = a + b;
      qs[vec][lo + h] = a - b;
    }
    __syncthreads();
  }
  T* out = static_cast<T*>(p.out) + token * p.o_stride_t;
  for (int i = tid; i < qpk * kHead; i += kThreads) {
    const int h = i / kHead, ch = i % kHead;
    const float x = qs[h][ch] * p.signs[ch] * inv_sqrt_d;
    if (split_kv) {
      p.part_acc[(part_row0 + h * p.num_splits) * kHead + ch] = x;
    } else {
      out[(kv_head * qpk + h) * p.o_stride_h + ch] = from_float<T>(x);
    }
  }
}

template <typename T, int D, int KBITS, int VBITS>
int launch_heads(const Params& p, int num_programs, int num_kv_heads, cudaStream_t stream) {
  const dim3 grid(num_programs, num_kv_heads, p.num_splits);
  if (p.queries_per_kv <= 8) {
    tq_decode_kernel<T, D, KBITS, VBITS, 1><<<grid, kThreads, 0, stream>>>(p);
  } else {
    tq_decode_kernel<T, D, KBITS, VBITS, 2><<<grid, kThreads, 0, stream>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int D>
int launch_codes(const Params& p, int key_bits, int value_bits, int num_programs,
                 int num_kv_heads, cudaStream_t stream) {
  if (key_bits == 8 && value_bits == 4) return launch_heads<T, D, 8, 4>(p, num_programs, num_kv_heads, stream);
  if (key_bits == 4 && value_bits == 4) return launch_heads<T, D, 4, 4>(p, num_programs, num_kv_heads, stream);
  if (key_bits == 3 && value_bits == 3) return launch_heads<T, D, 3, 3>(p, num_programs, num_kv_heads, stream);
  return -1;
}

template <typename T>
int launch_sizes(const Params& p, int key_bits, int value_bits, int num_programs,
                 int num_kv_heads, cudaStream_t stream) {
  if (p.head_size == 128) return launch_codes<T, 128>(p, key_bits, value_bits, num_programs, num_kv_heads, stream);
  if (p.head_size == 64) return launch_codes<T, 64>(p, key_bits, value_bits, num_programs, num_kv_heads, stream);
  return -1;
}

}  // namespace

extern "C" {

// Size of Params and the offset of each field in declaration order (-1 past the last), so that
// the caller can check its mirror of the struct field by field.
int tq_decode_params_size() { return static_cast<int>(sizeof(TQDecodeParams)); }

int tq_decode_params_offset(int field) {
  using P = TQDecodeParams;
  static const int offsets[] = {
      offsetof(P, query), offsetof(P, key), offsetof(P, value), offsetof(P, out),
      offsetof(P, cache), offsetof(P, block_table), offsetof(P, query_start_loc),
      offsetof(P, seq_lens), offsetof(P, qblock_req), offsetof(P, signs),
      offsetof(P, pair_table), offsetof(P, part_m), offsetof(P, part_l), offsetof(P, part_acc),
      offsetof(P, q_stride_t), offsetof(P, q_stride_h), offsetof(P, k_stride_t),
      offsetof(P, k_stride_h), offsetof(P, v_stride_t), offsetof(P, v_stride_h),
      offsetof(P, o_stride_t), offsetof(P, o_stride_h), offsetof(P, cache_stride_block),
      offsetof(P, cache_stride_head), offsetof(P, block_table_stride),
      offsetof(P, block_size_log2), offsetof(P, v_codes_offset), offsetof(P, k_meta_offset),
      offsetof(P, v_meta_offset), offsetof(P, queries_per_kv), offsetof(P, head_size),
      offsetof(P, num_splits), offsetof(P, scale)};
  const int n = static_cast<int>(sizeof(offsets) / sizeof(offsets[0]));
  return field >= 0 && field < n ? offsets[field] : -1;
}

// Whether this library's kernels can run on `device` (the driver may be older than the
// runtime it was built with): a cudaError_t, 0 when they can.
int tq_decode_probe(int device) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  cudaFuncAttributes attributes;
  err = cudaFuncGetAttributes(&attributes, tq_decode_kernel<__half, 128, 4, 4, 1>);
  return static_cast<int>(err);
}

// dtype: 0 float16, 1 bfloat16. Returns a cudaError_t (0: launched), or -1 for an unsupported
// combination.
// device: the stream's device (this library's runtime keeps its own current device).
int tq_decode_launch(const TQDecodeParams* params, int dtype, int key_bits, int value_bits,
                     int num_programs, int num_kv_heads, int device, void* stream) {
  if (params->queries_per_kv < 1 || params->queries_per_kv > 16) return -1;
  if (params->num_splits < 1 || params->num_splits > 65535) return -1;
  const cudaError_t set = cudaSetDevice(device);
  if (set != cudaSuccess) return static_cast<int>(set);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0) return launch_sizes<__half>(*params, key_bits, value_bits, num_programs, num_kv_heads, s);
  if (dtype == 1) return launch_sizes<__nv_bfloat16>(*params, key_bits, value_bits, num_programs, num_kv_heads, s);
  return -1;
}

}  // extern "C"
