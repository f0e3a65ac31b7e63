// reshape_and_cache: scatter the step's new K and V rows into the paged KV cache.
//
// Layout: key/value [T, Hkv, D] -> kv_cache[0 / 1, slot / block_size, slot % block_size, h, :].
// Launch: one CTA per token (grid = T), 128 threads; each thread moves 16-byte vectors of K and V
// for (head, vector) pairs of that token, so a token's Hkv*D*2 bytes of K (and of V) move as fully
// coalesced 16-byte accesses. Bound by HBM bandwidth (it reads and writes 2 * T * Hkv * D elements
// once); it is a small fraction of a step's traffic next to the attention read of the whole context.
// A negative slot means "skip": CUDA-graph batches pad slot_mapping with -1, so the padded rows of a
// replayed graph never write the cache (not even the null block).
// Light headers only (at::Tensor + c10 CUDA helpers): the full torch/extension.h costs minutes of
// host compile time per file.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.cuh"
#include "ops.h"

namespace ferrobatch {
namespace {

struct CacheParams {
  const void* key;
  const void* value;
  void* kv;
  const void* slots;
  int64_t k_stride_tok, k_stride_head;
  int64_t v_stride_tok, v_stride_head;
  int64_t kv_stride_kv, kv_stride_block, kv_stride_tok, kv_stride_head;
  int num_kv_heads, head_dim, block_size;
};

template <typename T, typename IdxT>
__global__ void __launch_bounds__(128) reshape_and_cache_kernel(const CacheParams p) {
  constexpr int VEC = Vec<T>::kElems;
  const int t = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(static_cast<const IdxT*>(p.slots)[t]);
  if (slot < 0) return;
  const int64_t blk = slot / p.block_size;
  const int64_t off = slot - blk * p.block_size;
  const int vec_per_head = p.head_dim / VEC;
  const int n_vec = p.num_kv_heads * vec_per_head;
  const T* key = static_cast<const T*>(p.key) + t * p.k_stride_tok;
  const T* value = static_cast<const T*>(p.value) + t * p.v_stride_tok;
  T* kdst = static_cast<T*>(p.kv) + blk * p.kv_stride_block + off * p.kv_stride_tok;
  T* vdst = kdst + p.kv_stride_kv;
  for (int i = threadIdx.x; i < n_vec; i += blockDim.x) {
    const int h = i / vec_per_head;
    const int c = (i - h * vec_per_head) * VEC;
    const uint4 kv = load_ro16(key + h * p.k_stride_head + c);
    const uint4 vv = load_ro16(value + h * p.v_stride_head + c);
    *reinterpret_cast<uint4*>(kdst + h * p.kv_stride_head + c) = kv;
    *reinterpret_cast<uint4*>(vdst + h * p.kv_stride_head + c) = vv;
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.is_cuda() && value.is_cuda() && kv_cache.is_cuda() && slot_mapping.is_cuda(),
              "reshape_and_cache: all tensors must be on CUDA");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value must be [T, Hkv, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value shapes differ");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key/value dtype must match kv_cache dtype");
  const int64_t T = key.size(0), Hkv = key.size(1), D = key.size(2);
  TORCH_CHECK(kv_cache.size(3) == Hkv && kv_cache.size(4) == D, "kv_cache head shape mismatch");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T, "slot_mapping must be [T]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int32 or int64");
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(4) == 1,
              "head_dim must be contiguous");
  const int vec = 16 / static_cast<int>(key.element_size());
  TORCH_CHECK(D % vec == 0, "head_dim must be a multiple of ", vec);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->stride(0) % vec == 0 && t->stride(1) % vec == 0 && aligned16(t->data_ptr()),
                "key/value rows must be 16-byte aligned");
  }
  for (int d = 0; d < 4; ++d)
    TORCH_CHECK(kv_cache.stride(d) % vec == 0, "kv_cache strides must be 16-byte multiples");
  TORCH_CHECK(aligned16(kv_cache.data_ptr()), "kv_cache must be 16-byte aligned");
  if (T == 0) return;

  const c10::cuda::CUDAGuard guard(kv_cache.device());
  CacheParams p;
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.slots = slot_mapping.data_ptr();
  p.k_stride_tok = key.stride(0);
  p.k_stride_head = key.stride(1);
  p.v_stride_tok = value.stride(0);
  p.v_stride_head = value.stride(1);
  p.kv_stride_kv = kv_cache.stride(0);
  p.kv_stride_block = kv_cache.stride(1);
  p.kv_stride_tok = kv_cache.stride(2);
  p.kv_stride_head = kv_cache.stride(3);
  p.num_kv_heads = static_cast<int>(Hkv);
  p.head_dim = static_cast<int>(D);
  p.block_size = static_cast<int>(kv_cache.size(2));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(T)), block(128);

#define FB_LAUNCH_CACHE(T_, I_) reshape_and_cache_kernel<T_, I_><<<grid, block, 0, stream>>>(p)
#define FB_DISPATCH_IDX(T_)                                     \
  if (slot_mapping.scalar_type() == at::kLong) FB_LAUNCH_CACHE(T_, int64_t); \
  else FB_LAUNCH_CACHE(T_, int32_t)

  switch (kv_cache.scalar_type()) {
    case at::kBFloat16: FB_DISPATCH_IDX(__nv_bfloat16); break;
    case at::kHalf: FB_DISPATCH_IDX(__half); break;
    case at::kFloat: FB_DISPATCH_IDX(float); break;
    default: TORCH_CHECK(false, "reshape_and_cache: unsupported dtype ", kv_cache.scalar_type());
  }
#undef FB_DISPATCH_IDX
#undef FB_LAUNCH_CACHE
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ferrobatch
