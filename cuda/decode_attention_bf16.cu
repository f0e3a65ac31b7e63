// The bf16 decode-attention kernels (see decode_attention.cuh), in a translation unit of their own.
#include "decode_attention.cuh"

namespace ferrobatch {
namespace decode {

template void decode_dispatch<__nv_bfloat16>(const DecodeParams&, int, int, int, int, cudaStream_t);

}  // namespace decode
}  // namespace ferrobatch
