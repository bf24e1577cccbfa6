// BGMV LoRA kernels for decode steps on the tensor path (Punica's "batched gather
// matrix-vector"): every token reads its own adapter's weights from the slot pool by its slot
// index, so a step of any mix of adapters is one shrink launch per projection group and one
// expand-add launch per projection, with no gather of x, no selection of slots and no scatter
// back (see crates/kernels/src/bgmv.rs, whose CPU reference computes exactly what these do,
// in the same order, and crates/model/src/slots.rs for the pool's layout).
//
// Built to PTX by crates/kernels/build.rs under the `cuda` feature. Numerics: every product is an
// explicit fmaf and every sum an explicit __fadd_rn, in an order fixed by the launch shape
// alone (not by timing), so the CPU reference can repeat it bit for bit; no fast-math (it
// would flush subnormals, which the CPU does not).
//
// Slot 0 of a pool holds zeros and stands for "no adapter" (base rows): those tokens read no
// weights. A slot at or past the pool's count is treated the same way, so a wrong index can
// never read outside the pool.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Ranks per thread in the shrink and per load in the expand: one 16-byte load of bf16/f16
// (two of f32). The pool's ranks are padded to a multiple of 8 (RANK_ALIGN in Rust), so a
// thread's 8 ranks never straddle two rows of a matrix and every load is aligned.
#define CHUNK 8

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

// Round-to-nearest-even, as half's from_f32 on the CPU.
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

// Eight consecutive weights as f32 (`p` 16-byte aligned for 16-bit types, 32 for f32).
template <typename W> __device__ __forceinline__ void load8(const W *p, float out[CHUNK]);
template <> __device__ __forceinline__ void load8<float>(const float *p, float out[CHUNK]) {
  const float4 a = reinterpret_cast<const float4 *>(p)[0];
  const float4 b = reinterpret_cast<const float4 *>(p)[1];
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
template <typename H> __device__ __forceinline__ void load8_16(const H *p, float out[CHUNK]) {
  const uint4 raw = *reinterpret_cast<const uint4 *>(p);
  const H *h = reinterpret_cast<const H *>(&raw);
#pragma unroll
  for (int j = 0; j < CHUNK; j++) out[j] = to_f32(h[j]);
}
template <> __device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16 *p, float out[CHUNK]) {
  load8_16(p, out);
}
template <> __device__ __forceinline__ void load8<__half>(const __half *p, float out[CHUNK]) {
  load8_16(p, out);
}

// Shrink, split over the input: v[z, p, t, k] = sum over the rows i of split z of
// x[t, i] * At[slot[t] * n + p, i, k], for every split z (grid.z), projection p of the group
// (grid.y) and token t (grid.x), in f32. The expand adds the splits' partial sums.
//
// Why split: a decode step has few tokens, and one block per (token, projection) would leave
// most SMs idle while a few stream a whole matrix each with only a block's loads in flight;
// splits of `split` rows (about 16 KiB of weights each) spread every matrix over many blocks.
//
// x: [tokens, d_in] contiguous; at: the group's pool [slots * n, d_in, rank] (Aᵀ, ranks
// contiguous); v: [splits, n, tokens, rank] f32. A block of `groups * rank / 8` threads:
// thread (g, c) sums ranks 8c..8c+8 over its split's rows i = z*split + g, + groups,
// + 2 groups, ... in that order (one fmaf each), then the `groups` partial sums of each rank
// are added in a tree: for s = groups/2, groups/4, ..., 1: part[g] = part[g] + part[g + s] for
// g < s. `groups` is a power of two; dynamic shared memory holds groups * rank floats.
template <typename X, typename W>
__device__ void shrink(const X *__restrict__ x, const W *__restrict__ at,
                       const uint32_t *__restrict__ slots, float *__restrict__ v,
                       uint32_t tokens, uint32_t d_in, uint32_t rank, uint32_t n,
                       uint32_t num_slots, uint32_t groups, uint32_t split) {
  extern __shared__ float part[];
  const uint32_t t = blockIdx.x, p = blockIdx.y, z = blockIdx.z;
  const uint32_t chunks = rank / CHUNK;
  const uint32_t c = threadIdx.x % chunks, g = threadIdx.x / chunks;
  const uint32_t k0 = c * CHUNK;
  float *out = v + (((size_t)z * n + p) * tokens + t) * rank;
  const uint32_t slot = slots[t];
  if (slot == 0 || slot >= num_slots) {
    // No adapter: a zero update (the block exits together, before any barrier).
    if (g == 0) {
#pragma unroll
      for (int j = 0; j < CHUNK; j++) out[k0 + j] = 0.0f;
    }
    return;
  }
  const W *a = at + ((size_t)slot * n + p) * d_in * rank + k0;
  const X *xr = x + (size_t)t * d_in;
  float acc[CHUNK];
#pragma unroll
  for (int j = 0; j < CHUNK; j++) acc[j] = 0.0f;
  const uint32_t end = min(d_in, (z + 1) * split);
#pragma unroll 4
  for (uint32_t i = z * split + g; i < end; i += groups) {
    const float xi = to_f32(xr[i]);
    float w[CHUNK];
    load8(a + (size_t)i * rank, w);
#pragma unroll
    for (int j = 0; j < CHUNK; j++) acc[j] = fmaf(xi, w[j], acc[j]);
  }
#pragma unroll
  for (int j = 0; j < CHUNK; j++) part[g * rank + k0 + j] = acc[j];
  __syncthreads();
  for (uint32_t s = groups / 2; s > 0; s /= 2) {
    if (g < s) {
#pragma unroll
      for (int j = 0; j < CHUNK; j++)
        part[g * rank + k0 + j] = __fadd_rn(part[g * rank + k0 + j], part[(g + s) * rank + k0 + j]);
    }
    __syncthreads();
  }
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < CHUNK; j++) out[k0 + j] = part[k0 + j];
  }
}

// Expand-add: out[t, o] = y[t, o] + sum_k v[p, t, k] * B[slot[t], o, k], where
// v[p, t, k] = ((part[0] + part[1]) + part[2]) + ... over the shrink's splits in order, the
// sum in f32 over k = 0, 1, ..., rank-1 in that order (one fmaf each), the add in f32, one
// rounding to Y.
//
// y: [tokens, d_out] rows `y_stride` apart (a column slice of a fused product is read in
// place); v: the shrink's partial sums [splits, n, tokens, rank] f32, p = `proj` its
// projection; b: the projection's pool [slots, d_out, rank] (s·B, the scale folded in when
// the slot was loaded); out: [tokens, d_out] contiguous. Grid (ceil(d_out / blockDim),
// tokens), one output per thread; the token's v row is summed into shared memory.
template <typename Y, typename W>
__device__ void expand(const Y *__restrict__ y, uint64_t y_stride, const float *__restrict__ v,
                       const W *__restrict__ b, const uint32_t *__restrict__ slots,
                       Y *__restrict__ out, uint32_t tokens, uint32_t d_out, uint32_t rank,
                       uint32_t proj, uint32_t num_slots, uint32_t n, uint32_t splits) {
  extern __shared__ float vs[];
  const uint32_t t = blockIdx.y;
  const uint32_t o = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t slot = slots[t];
  const bool adapter = slot != 0 && slot < num_slots;
  if (adapter) {
    const size_t stride = (size_t)n * tokens * rank;
    const float *vr = v + ((size_t)proj * tokens + t) * rank;
    for (uint32_t k = threadIdx.x; k < rank; k += blockDim.x) {
      float sum = vr[k];
      for (uint32_t z = 1; z < splits; z++) sum = __fadd_rn(sum, vr[z * stride + k]);
      vs[k] = sum;
    }
    __syncthreads();
  }
  if (o >= d_out) return;
  const Y yo = y[(size_t)t * y_stride + o];
  if (!adapter) {
    out[(size_t)t * d_out + o] = yo;
    return;
  }
  const W *br = b + ((size_t)slot * d_out + o) * rank;
  float acc = 0.0f;
  for (uint32_t k = 0; k < rank; k += CHUNK) {
    float w[CHUNK];
    load8(br + k, w);
#pragma unroll
    for (int j = 0; j < CHUNK; j++) acc = fmaf(vs[k + j], w[j], acc);
  }
  out[(size_t)t * d_out + o] = from_f32<Y>(__fadd_rn(to_f32(yo), acc));
}

// One entry point per (activation, weight) dtype pair: the pool may be wider than the
// activations (loraDtype f32 over bf16/f16 weights) or hold their dtype.
#define INSTANCES(XN, X, WN, W)                                                                \
  extern "C" __global__ void bgmv_shrink_##XN##_##WN(                                          \
      const X *x, const W *at, const uint32_t *slots, float *v, uint32_t tokens, uint32_t d_in, \
      uint32_t rank, uint32_t n, uint32_t num_slots, uint32_t groups, uint32_t split) {        \
    shrink<X, W>(x, at, slots, v, tokens, d_in, rank, n, num_slots, groups, split);             \
  }                                                                                            \
  extern "C" __global__ void bgmv_expand_##XN##_##WN(                                          \
      const X *y, uint64_t y_stride, const float *v, const W *b, const uint32_t *slots, X *out, \
      uint32_t tokens, uint32_t d_out, uint32_t rank, uint32_t proj, uint32_t num_slots,       \
      uint32_t n, uint32_t splits) {                                                           \
    expand<X, W>(y, y_stride, v, b, slots, out, tokens, d_out, rank, proj, num_slots, n,       \
                 splits);                                                                      \
  }

INSTANCES(f32, float, f32, float)
INSTANCES(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
INSTANCES(f16, __half, f16, __half)
INSTANCES(bf16, __nv_bfloat16, f32, float)
INSTANCES(f16, __half, f32, float)
INSTANCES(f32, float, bf16, __nv_bfloat16)
INSTANCES(f32, float, f16, __half)
