// Registers the kernels as torch ops: torch.ops.ferrobatch.<name>.
//
// Schemas mark every written tensor as mutated (Tensor(a!)) and return (), so autograd/functionalization
// and CUDA-graph capture see the side effects. Only a CUDA implementation is registered: calling an
// op on CPU tensors fails with torch's "no kernel for CPU" error instead of doing something silent.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(ferrobatch, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor(b!) partial_out, Tensor(c!) partial_lse, float scale, "
      "int num_splits, Tensor(d!)? split_counters=None) -> ()");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int max_query_len, "
      "Tensor? seq_ids=None) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor delta, Tensor weight, "
      "float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_inplace(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def(
      "rotary_and_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, "
      "Tensor(c!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(ferrobatch, CUDA, m) {
  m.impl("reshape_and_cache", &ferrobatch::reshape_and_cache);
  m.impl("paged_decode_attention", &ferrobatch::paged_decode_attention);
  m.impl("paged_prefill_attention", &ferrobatch::paged_prefill_attention);
  m.impl("rms_norm", &ferrobatch::rms_norm);
  m.impl("add_rms_norm", &ferrobatch::add_rms_norm);
  m.impl("silu_and_mul", &ferrobatch::silu_and_mul);
  m.impl("rotary_inplace", &ferrobatch::rotary_inplace);
  m.impl("rotary_and_cache", &ferrobatch::rotary_and_cache);
}
