// ferrobatch CUDA ops: host-side entry points (defined in the .cu files, registered in ops.cpp).
//
// All ops write into caller-provided tensors and return nothing, allocate nothing and never
// synchronize with the host, so a decode step that calls them can be captured in a CUDA graph.
// They launch on the current CUDA stream of the tensors' device.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace ferrobatch {

// Scatter this step's new keys/values into the paged cache.
//   key, value:    [T, Hkv, D] (bf16/fp16/fp32; any token/head strides, head_dim contiguous)
//   kv_cache:      [2, num_blocks, block_size, Hkv, D], same dtype (written)
//   slot_mapping:  [T] int32 or int64, block_id * block_size + offset; a negative slot skips the
//                  token (padding rows of a CUDA-graph batch).
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping);

// Paged decode attention, one query token per sequence (flash-decoding split-KV).
//   out:          [B, Hq, D] contiguous, dtype of q (written)
//   q:            [B, Hq, D] (any token/head strides, head_dim contiguous)
//   block_tables: [B, M] int32; seq_lens: [B] int32 (context incl. the new token; <= 0 => out = 0)
//   partial_out:  [B_ws >= B, Hq, S_max, D] fp32 workspace; partial_lse: [B_ws, Hq, S_max] fp32
//   num_splits:   KV splits per sequence, 1 <= num_splits <= S_max (1 = no reduce pass)
//   split_counters: optional int32 [>= B * Hq], zero before the first launch (left zero): the
//                 last split CTA of each (sequence, KV head) reduces, no reduce pass
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            at::Tensor& partial_out, at::Tensor& partial_lse, double scale,
                            int64_t num_splits, const std::optional<at::Tensor>& split_counters);

// Causal attention for a flat batch of variable-length query chunks over the paged cache (prefill
// chunks, decode tokens, or both mixed). Keys/values of the new tokens must already be in the cache.
//   out, q:          [T, Hq, D] (out written; any token/head strides, head_dim contiguous)
//   query_start_loc: [B+1] int32; seq_lens: [B] int32; block_tables: [B, M] int32
//   max_query_len:   host-side max of the per-sequence query lengths (sizes the grid)
//   seq_ids:         optional int32 [S]: only these sequences are computed (only their rows of
//                    out are written), e.g. the prefill sequences of a mixed batch
void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, double scale,
                             int64_t max_query_len, const std::optional<at::Tensor>& seq_ids);

// Elementwise ops of the Llama layer (elementwise.cu), rounding as torch's eager ops round.
//   rms_norm:       out = weight * (x * rsqrt(mean(x^2) + eps)).to(T); x, out [T, H] (rows may be
//                   strided), weight [H]
//   add_rms_norm:   sum = (x + delta).to(T), out = rms_norm(sum); out, sum, x, delta [T, H]
//                   (rows may be strided), weight [H]
//   silu_and_mul:   out [T, I] = silu(x[:, :I]) * x[:, I:]; x [T, 2I]
//   rotary_inplace: rotates q [T, Hq, D] and k [T, Hkv, D] (any token/head strides) in place with
//                   cos, sin [T, D] contiguous (the tables of each token's position), half-split form
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x, const at::Tensor& delta,
                  const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
void rotary_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
// rotary_and_cache: rotary_inplace, then reshape_and_cache of the rotated k and of v (same
//                   kv_cache layout and slot_mapping rules, a negative slot skips the token) in one
//                   kernel; v [T, Hkv, D] any token/head strides; one dtype for all
void rotary_and_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping);

}  // namespace ferrobatch
