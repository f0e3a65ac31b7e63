// Paged decode attention: the op entry point (tensor checks, parameters, dtype dispatch). The
// kernels and the design notes are in decode_attention.cuh; decode_attention_{bf16,fp16,fp32}.cu
// compile them, one dtype each.
#include "decode_attention.cuh"

namespace ferrobatch {
namespace {

using decode::DecodeParams;
using decode::decode_dispatch;

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int block_shift_of(int block_size) {
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -1;
  int shift = 0;
  while ((1 << shift) < block_size) ++shift;
  return shift;
}

}  // namespace

void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            at::Tensor& partial_out, at::Tensor& partial_lse, double scale,
                            int64_t num_splits, const std::optional<at::Tensor>& split_counters) {
  TORCH_CHECK(q.is_cuda() && out.is_cuda() && kv_cache.is_cuda() && block_tables.is_cuda() &&
                  seq_lens.is_cuda() && partial_out.is_cuda() && partial_lse.is_cuda(),
              "paged_decode_attention: all tensors must be on CUDA");
  TORCH_CHECK(q.dim() == 3, "q must be [B, Hq, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, Hkv, D]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D, "head_dim of q and kv_cache differ");
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128, got ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t G = Hq / Hkv;
  TORCH_CHECK(G <= 8, "GQA ratio > 8 is not supported by the CUDA decode kernel");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and kv_cache must share a dtype");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == B && out.size(1) == Hq && out.size(2) == D &&
                  out.is_contiguous(),
              "out must be a contiguous [B, Hq, D] tensor");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.stride(4) == 1, "head_dim must be contiguous");
  const int vec = 16 / static_cast<int>(q.element_size());
  TORCH_CHECK(q.stride(0) % vec == 0 && q.stride(1) % vec == 0 && aligned16(q.data_ptr()),
              "q rows must be 16-byte aligned");
  for (int d = 0; d < 4; ++d)
    TORCH_CHECK(kv_cache.stride(d) % vec == 0, "kv_cache strides must be 16-byte multiples");
  TORCH_CHECK(aligned16(kv_cache.data_ptr()), "kv_cache must be 16-byte aligned");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) >= B && block_tables.stride(1) == 1,
              "block_tables must be int32 [>=B, M] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) >= B &&
                  seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 [>=B]");
  TORCH_CHECK(num_splits >= 1, "num_splits must be >= 1");
  if (num_splits > 1) {
    TORCH_CHECK(partial_out.scalar_type() == at::kFloat && partial_lse.scalar_type() == at::kFloat,
                "workspaces must be float32");
    TORCH_CHECK(partial_out.dim() == 4 && partial_out.size(0) >= B && partial_out.size(1) == Hq &&
                    partial_out.size(3) == D && partial_out.is_contiguous(),
                "partial_out must be contiguous float32 [>=B, Hq, S_max, D]");
    TORCH_CHECK(partial_lse.dim() == 3 && partial_lse.size(0) >= B && partial_lse.size(1) == Hq &&
                    partial_lse.size(2) == partial_out.size(2) && partial_lse.is_contiguous(),
                "partial_lse must be contiguous float32 [>=B, Hq, S_max]");
    TORCH_CHECK(num_splits <= partial_out.size(2), "num_splits exceeds the workspace (",
                partial_out.size(2), ")");
    if (split_counters.has_value()) {
      const at::Tensor& c = *split_counters;
      TORCH_CHECK(c.is_cuda() && c.scalar_type() == at::kInt && c.is_contiguous() &&
                      c.numel() >= B * Hq,
                  "split_counters must be a contiguous int32 CUDA tensor of >= B * Hq elements "
                  "(zero before the first launch; the kernel leaves it zero)");
    }
  }
  TORCH_CHECK(B <= 65535, "batch too large for gridDim.z");
  if (B == 0) return;

  const c10::cuda::CUDAGuard guard(q.device());
  DecodeParams p;
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.partial_out = num_splits > 1 ? partial_out.data_ptr<float>() : nullptr;
  p.partial_lse = num_splits > 1 ? partial_lse.data_ptr<float>() : nullptr;
  p.split_counters = num_splits > 1 && split_counters.has_value()
                         ? split_counters->data_ptr<int32_t>() : nullptr;
  p.q_stride_tok = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.kv_stride_kv = kv_cache.stride(0);
  p.kv_stride_block = kv_cache.stride(1);
  p.kv_stride_tok = kv_cache.stride(2);
  p.kv_stride_head = kv_cache.stride(3);
  p.bt_stride = block_tables.stride(0);
  p.num_heads = static_cast<int>(Hq);
  p.group = static_cast<int>(G);
  p.block_size = static_cast<int>(kv_cache.size(2));
  p.block_shift = block_shift_of(p.block_size);
  p.num_splits = static_cast<int>(num_splits);
  p.max_splits = num_splits > 1 ? static_cast<int>(partial_out.size(2)) : 1;
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int iB = static_cast<int>(B), iHkv = static_cast<int>(Hkv), iHq = static_cast<int>(Hq);
  switch (q.scalar_type()) {
    case at::kBFloat16: decode_dispatch<__nv_bfloat16>(p, static_cast<int>(D), iB, iHkv, iHq, stream); break;
    case at::kHalf: decode_dispatch<__half>(p, static_cast<int>(D), iB, iHkv, iHq, stream); break;
    case at::kFloat: decode_dispatch<float>(p, static_cast<int>(D), iB, iHkv, iHq, stream); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace ferrobatch
