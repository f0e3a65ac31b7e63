// Elementwise ops of the Llama layer, one kernel each where torch's eager ops take several:
//
//   rms_norm       out = weight * (x * rsqrt(mean(x^2) + eps)).to(T)      (torch: ~8 kernels)
//   add_rms_norm   sum = (x + delta).to(T), out = rms_norm(sum)             (torch: ~9 kernels)
//   silu_and_mul   out = silu(x[:, :I]).to(T) * x[:, I:]                   (torch: 2 kernels)
//   rotary_inplace q, k rotated in place, half-split (GPT-NeoX / HF) form  (torch: ~10 kernels)
//   rotary_and_cache  rotary_inplace, then the rotated k and v stored in the paged KV cache at
//                  slot_mapping (what reshape_and_cache does): one kernel instead of two
//
// Each kernel rounds where torch's eager ops round (to T after every op: the normalised row before
// the weight, silu before the product, each product and the sum of the rotation), so bf16 / fp16
// results match the torch reference up to the reduction order of the mean square; fp32 has no
// intermediate rounding. Scalar loads: these ops move a few MB per step, next to the GEMMs and
// the attention; what they save is launches (inside a CUDA graph, ~2 us each).
// Launch: one CTA per token row (grid = T), 256 threads striding over the row.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.cuh"
#include "ops.h"

namespace ferrobatch {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// Sum over the CTA (kThreads threads); every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  return total;
}

// out = weight * (s * rsqrt(mean(s^2) + eps)).to(T) with s = x, or with kAdd (the residual add
// before a norm, fused) s = (x + delta).to(T), rounded as torch's add rounds and also written to
// `sum`. Each thread re-reads only the sum elements it wrote itself.
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(T* __restrict__ out, T* __restrict__ sum, const T* __restrict__ x,
                    const T* __restrict__ delta, const T* __restrict__ weight, int64_t x_stride,
                    int64_t delta_stride, int64_t out_stride, int64_t sum_stride, int hidden,
                    float eps) {
  const T* xr = x + blockIdx.x * x_stride;
  T* sr = kAdd ? sum + blockIdx.x * sum_stride : nullptr;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < hidden; i += kThreads) {
    float v = to_float(xr[i]);
    if (kAdd) {
      v = round_to<T>(__fadd_rn(v, to_float(delta[blockIdx.x * delta_stride + i])));
      sr[i] = from_float<T>(v);
    }
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
  const T* src = kAdd ? sr : xr;
  T* dst = out + blockIdx.x * out_stride;
  for (int i = threadIdx.x; i < hidden; i += kThreads) {
    const float normed = round_to<T>(__fmul_rn(to_float(src[i]), inv_rms));
    dst[i] = from_float<T>(__fmul_rn(to_float(weight[i]), normed));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                        int64_t out_stride, int inter) {
  const T* row = x + blockIdx.x * x_stride;
  T* dst = out + blockIdx.x * out_stride;
  for (int i = threadIdx.x; i < inter; i += kThreads) {
    const float g = to_float(row[i]);
    const float silu = round_to<T>(g / (1.f + expf(-g)));
    dst[i] = from_float<T>(__fmul_rn(silu, to_float(row[inter + i])));
  }
}

// Rotates the pair (row[d], row[d + half]) in place; returns the two rotated values.
// x * cos + cat(-x2, x1) * sin, each op rounded to T as torch's eager ops round
// (__fmul_rn / __fadd_rn: never contracted into an FMA, so fp32 rounds as torch's ops do).
template <typename T>
__device__ __forceinline__ void rotate_pair(T* row, const T* c, const T* s, int d, int half,
                                            T& lo_out, T& hi_out) {
  const float x1 = to_float(row[d]), x2 = to_float(row[d + half]);
  const float lo = __fadd_rn(round_to<T>(__fmul_rn(x1, to_float(c[d]))),
                             round_to<T>(__fmul_rn(-x2, to_float(s[d]))));
  const float hi = __fadd_rn(round_to<T>(__fmul_rn(x2, to_float(c[d + half]))),
                             round_to<T>(__fmul_rn(x1, to_float(s[d + half]))));
  lo_out = from_float<T>(lo);
  hi_out = from_float<T>(hi);
  row[d] = lo_out;
  row[d + half] = hi_out;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(T* q, T* k, const T* __restrict__ cos, const T* __restrict__ sin,
                  int64_t q_stride_tok, int64_t q_stride_head, int64_t k_stride_tok,
                  int64_t k_stride_head, int num_q_heads, int num_k_heads, int head_dim) {
  const int half = head_dim / 2;
  const int t = blockIdx.x;
  const T* c = cos + static_cast<int64_t>(t) * head_dim;
  const T* s = sin + static_cast<int64_t>(t) * head_dim;
  const int pairs = (num_q_heads + num_k_heads) * half;
  for (int i = threadIdx.x; i < pairs; i += kThreads) {
    const int h = i / half, d = i - h * half;
    T* row = h < num_q_heads ? q + t * q_stride_tok + h * q_stride_head
                             : k + t * k_stride_tok + (h - num_q_heads) * k_stride_head;
    T lo, hi;
    rotate_pair(row, c, s, d, half, lo, hi);
  }
}

// rotary_and_cache: the rotation of rotary_kernel, and token t's rotated K and its V stored in
// the cache at slots[t] (skipped for a negative slot, the padding rows of a CUDA-graph batch).
// Each thread stores the very values it wrote back to k, so the cache holds exactly what
// rotary_inplace + reshape_and_cache would leave there.
struct RotaryCacheParams {
  void* q;
  void* k;
  const void* v;
  const void* cos;
  const void* sin;
  void* kv;
  const void* slots;
  int64_t q_stride_tok, q_stride_head, k_stride_tok, k_stride_head, v_stride_tok, v_stride_head;
  int64_t kv_stride_kv, kv_stride_block, kv_stride_tok, kv_stride_head;
  int num_q_heads, num_kv_heads, head_dim, block_size;
};

template <typename T, typename IdxT>
__global__ void __launch_bounds__(kThreads) rotary_and_cache_kernel(const RotaryCacheParams p) {
  const int half = p.head_dim / 2;
  const int t = blockIdx.x;
  const T* c = static_cast<const T*>(p.cos) + static_cast<int64_t>(t) * p.head_dim;
  const T* s = static_cast<const T*>(p.sin) + static_cast<int64_t>(t) * p.head_dim;
  const int64_t slot = static_cast<int64_t>(static_cast<const IdxT*>(p.slots)[t]);
  const int64_t blk = slot >= 0 ? slot / p.block_size : 0;
  T* kdst = static_cast<T*>(p.kv) + blk * p.kv_stride_block +
            (slot >= 0 ? slot - blk * p.block_size : 0) * p.kv_stride_tok;
  T* vdst = kdst + p.kv_stride_kv;
  T* q = static_cast<T*>(p.q) + t * p.q_stride_tok;
  T* k = static_cast<T*>(p.k) + t * p.k_stride_tok;
  const int pairs = (p.num_q_heads + p.num_kv_heads) * half;
  for (int i = threadIdx.x; i < pairs; i += kThreads) {
    const int h = i / half, d = i - h * half;
    const bool is_k = h >= p.num_q_heads;
    const int kh = h - p.num_q_heads;
    T* row = is_k ? k + kh * p.k_stride_head : q + h * p.q_stride_head;
    T lo, hi;
    rotate_pair(row, c, s, d, half, lo, hi);
    if (is_k && slot >= 0) {
      T* dst = kdst + kh * p.kv_stride_head;
      dst[d] = lo;
      dst[d + half] = hi;
    }
  }
  if (slot < 0) return;
  const T* v = static_cast<const T*>(p.v) + t * p.v_stride_tok;
  const int n_v = p.num_kv_heads * p.head_dim;
  for (int i = threadIdx.x; i < n_v; i += kThreads) {
    const int h = i / p.head_dim, d = i - h * p.head_dim;
    vdst[h * p.kv_stride_head + d] = v[h * p.v_stride_head + d];
  }
}

void check_cuda_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

}  // namespace

#define FB_DISPATCH_FLOAT(DTYPE, NAME, ...)                                         \
  switch (DTYPE) {                                                                  \
    case at::kBFloat16: { using scalar_t = __nv_bfloat16; __VA_ARGS__; } break;     \
    case at::kHalf: { using scalar_t = __half; __VA_ARGS__; } break;                \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; } break;                \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", DTYPE);                \
  }

// rms_norm and add_rms_norm: the checks and the launch (sum and delta null for the plain norm).
static void launch_rms_norm(at::Tensor& out, at::Tensor* sum, const at::Tensor& x,
                            const at::Tensor* delta, const at::Tensor& weight, double eps,
                            const char* name) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out),
                              static_cast<const at::Tensor*>(sum), &x, delta}) {
    if (t == nullptr) continue;
    check_cuda_rows(*t, name);
    TORCH_CHECK(t->dim() == 2 && t->sizes() == x.sizes(), name,
                ": out, x (and sum, delta) must be [T, H]");
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), name, ": one dtype for all tensors");
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight must be [H], contiguous, of x's dtype");
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const unsigned rows = static_cast<unsigned>(x.size(0));
  const int hidden = static_cast<int>(x.size(1));
  FB_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", {
    scalar_t* o = static_cast<scalar_t*>(out.data_ptr());
    const scalar_t* xp = static_cast<const scalar_t*>(x.data_ptr());
    const scalar_t* w = static_cast<const scalar_t*>(weight.data_ptr());
    if (sum != nullptr) {
      rms_norm_kernel<scalar_t, true><<<rows, kThreads, 0, stream>>>(
          o, static_cast<scalar_t*>(sum->data_ptr()), xp,
          static_cast<const scalar_t*>(delta->data_ptr()), w, x.stride(0), delta->stride(0),
          out.stride(0), sum->stride(0), hidden, static_cast<float>(eps));
    } else {
      rms_norm_kernel<scalar_t, false><<<rows, kThreads, 0, stream>>>(
          o, nullptr, xp, nullptr, w, x.stride(0), 0, out.stride(0), 0, hidden,
          static_cast<float>(eps));
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  launch_rms_norm(out, nullptr, x, nullptr, weight, eps, "rms_norm");
}

void add_rms_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x, const at::Tensor& delta,
                  const at::Tensor& weight, double eps) {
  launch_rms_norm(out, &sum, x, &delta, weight, eps, "add_rms_norm");
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_cuda_rows(x, "x");
  check_cuda_rows(out, "out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) &&
                  x.size(1) == 2 * out.size(1),
              "silu_and_mul: x must be [T, 2I] and out [T, I]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "silu_and_mul: x and out must share a dtype");
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  FB_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul",
      silu_and_mul_kernel<scalar_t><<<static_cast<unsigned>(x.size(0)), kThreads, 0, stream>>>(
          static_cast<scalar_t*>(out.data_ptr()), static_cast<const scalar_t*>(x.data_ptr()),
          x.stride(0), out.stride(0), static_cast<int>(out.size(1))));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rotary_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_cuda_rows(q, "q");
  check_cuda_rows(k, "k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_inplace: q must be [T, Hq, D] and k [T, Hkv, D]");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0, "rotary_inplace: head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == D,
                "rotary_inplace: cos and sin must be [T, D], contiguous");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "rotary_inplace: cos/sin dtype must be q's");
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_inplace: q and k must share a dtype");
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  FB_DISPATCH_FLOAT(q.scalar_type(), "rotary_inplace",
      rotary_kernel<scalar_t><<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
          static_cast<scalar_t*>(q.data_ptr()), static_cast<scalar_t*>(k.data_ptr()),
          static_cast<const scalar_t*>(cos.data_ptr()), static_cast<const scalar_t*>(sin.data_ptr()),
          q.stride(0), q.stride(1), k.stride(0), k.stride(1), static_cast<int>(q.size(1)),
          static_cast<int>(k.size(1)), static_cast<int>(D)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rotary_and_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  check_cuda_rows(q, "q");
  check_cuda_rows(k, "k");
  check_cuda_rows(v, "v");
  TORCH_CHECK(kv_cache.is_cuda() && slot_mapping.is_cuda(),
              "rotary_and_cache: kv_cache and slot_mapping must be on CUDA");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_and_cache: q must be [T, Hq, D] and k [T, Hkv, D]");
  TORCH_CHECK(v.sizes() == k.sizes(), "rotary_and_cache: v must have k's shape [T, Hkv, D]");
  const int64_t T = q.size(0), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(D % 2 == 0, "rotary_and_cache: head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == D,
                "rotary_and_cache: cos and sin must be [T, D], contiguous");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "rotary_and_cache: cos/sin dtype must be q's");
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  kv_cache.scalar_type() == q.scalar_type(),
              "rotary_and_cache: q, k, v and kv_cache must share a dtype");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == Hkv &&
                  kv_cache.size(4) == D && kv_cache.stride(4) == 1,
              "rotary_and_cache: kv_cache must be [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.is_contiguous(),
              "rotary_and_cache: slot_mapping must be contiguous [T]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
              "rotary_and_cache: slot_mapping must be int32 or int64");
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  RotaryCacheParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.slots = slot_mapping.data_ptr();
  p.q_stride_tok = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.k_stride_tok = k.stride(0);
  p.k_stride_head = k.stride(1);
  p.v_stride_tok = v.stride(0);
  p.v_stride_head = v.stride(1);
  p.kv_stride_kv = kv_cache.stride(0);
  p.kv_stride_block = kv_cache.stride(1);
  p.kv_stride_tok = kv_cache.stride(2);
  p.kv_stride_head = kv_cache.stride(3);
  p.num_q_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(Hkv);
  p.head_dim = static_cast<int>(D);
  p.block_size = static_cast<int>(kv_cache.size(2));
  const bool long_slots = slot_mapping.scalar_type() == at::kLong;
  FB_DISPATCH_FLOAT(q.scalar_type(), "rotary_and_cache", {
    if (long_slots)
      rotary_and_cache_kernel<scalar_t, int64_t><<<static_cast<unsigned>(T), kThreads, 0, stream>>>(p);
    else
      rotary_and_cache_kernel<scalar_t, int32_t><<<static_cast<unsigned>(T), kThreads, 0, stream>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#undef FB_DISPATCH_FLOAT

}  // namespace ferrobatch
