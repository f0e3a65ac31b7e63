// ferrobatch CUDA kernels: shared helpers.
//
// Everything here is header-only device code used by reshape_and_cache.cu, decode_attention.cu and
// prefill_attention.cu. Conventions shared by all kernels:
//
//   * KV cache, per layer: one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
//     (index 0 = K, 1 = V). Kernels take its four outer strides in *elements*, so the cache may be a
//     view (e.g. one slice of a [layers, 2, ...] allocation); the head_dim axis must be contiguous.
//   * Block 0 is the reserved null block (padding in block tables); kernels never need it specially
//     because they never read past a sequence's seq_len.
//   * All global K/V/Q/O traffic is in 16-byte vectors (8 bf16/fp16 or 4 fp32 elements), which needs
//     head_dim % 8 == 0 and 16-byte aligned base pointers and strides. The host wrappers check this.
//   * Arithmetic is fp32; softmax runs in the log2 domain (q is pre-scaled by scale * log2(e), so
//     exp(x * scale) == exp2(q_scaled . k)), which turns every exp into one ex2.approx.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace ferrobatch {

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullMask = 0xffffffffu;

// Number of elements of T in one 16-byte vector.
template <typename T>
struct Vec {
  static constexpr int kElems = 16 / sizeof(T);
};

// ---- 16-byte vector <-> fp32 conversions -------------------------------------------------------
// Only the explicit conversion intrinsics are used: torch builds with __CUDA_NO_HALF_CONVERSIONS__
// and friends, so implicit half/bf16 <-> float conversions do not exist.

template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&f)[Vec<T>::kElems]);

template <>
__device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(p[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

template <>
__device__ __forceinline__ void unpack<__half>(const uint4& raw, float (&f)[8]) {
  const __half2* p = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(p[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

template <>
__device__ __forceinline__ void unpack<float>(const uint4& raw, float (&f)[4]) {
  f[0] = __uint_as_float(raw.x);
  f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z);
  f[3] = __uint_as_float(raw.w);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float (&f)[Vec<T>::kElems]);

template <>
__device__ __forceinline__ uint4 pack<__nv_bfloat16>(const float (&f)[8]) {
  uint4 raw;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}

template <>
__device__ __forceinline__ uint4 pack<__half>(const float (&f)[8]) {
  uint4 raw;
  __half2* p = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}

template <>
__device__ __forceinline__ uint4 pack<float>(const float (&f)[4]) {
  return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                    __float_as_uint(f[3]));
}

// Scalar store of one fp32 value as T (used where a thread owns single output elements).
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}

// Scalar load of one T as fp32.
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// ---- loads --------------------------------------------------------------------------------------

// 16-byte load of K/V from the paged cache. Every K/V byte is read exactly once per launch (one CTA
// serves all query heads of its KV head, splits are disjoint), so use the streaming ("evict first")
// cache hint: the cache lines are dead after this read and should not push Q/out/block tables out
// of L2.
__device__ __forceinline__ uint4 load_kv16(const void* ptr) {
  return __ldcs(reinterpret_cast<const uint4*>(ptr));
}

// 16-byte read-only load through the non-coherent path (queries, keys/values to be cached).
__device__ __forceinline__ uint4 load_ro16(const void* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace ferrobatch
