// Paged decode attention (one query token per sequence), flash-decoding style split-KV.
//
// ---- What bounds it ------------------------------------------------------------------------------
// A decode step reads every cached K and V element of every sequence once and does ~2 FLOP per
// element per query head of the group: with GQA ratio G that is 2*G FLOP per 2-byte element, far
// below the ~200 FLOP/byte ridge of an H200. The kernel is HBM-bandwidth bound; the design goal is
// that the bytes moved are exactly the K/V bytes (each read once) and that enough of them are in
// flight to cover HBM latency (Little's law: ~4.3 TB/s * ~0.7 us ~= 3 MB in flight, ~24 KB per SM).
//
// ---- Work decomposition ------------------------------------------------------------------------
// grid = (num_splits, Hkv, B); one CTA = one (sequence, KV head, KV split).
//   * GQA: the CTA computes all G = Hq/Hkv query heads that share its KV head, so each K/V row is
//     read from HBM once, not G times. G is padded to GP in {1,2,4,8} at compile time (register
//     arrays need constant sizes); padded heads use q = 0 and are never stored.
//   * Split-KV: sequence b's context [0, L) is cut into chunks of
//         chunk = round_up(max(ceil(L / num_splits), kMinChunk), 64)
//     computed *on the device* from seq_lens, so the grid depends only on (B, Hkv, num_splits) and a
//     captured CUDA graph stays valid for any seq_lens. Splits past ceil(L / chunk) exit at once.
//     The host picks num_splits so that B*Hkv*num_splits fills the GPU (~4 CTAs per SM) even at
//     small batch; with num_splits == 1 the CTA writes the final output directly (kDirect) and no
//     reduce pass runs.
//
// ---- Inside a CTA (128 threads = 4 warps) --------------------------------------------------------
// A "row group" of TPR = D / VEC threads owns one token's K row (and later its V row): each thread
// holds one 16-byte vector (8 bf16/fp16 or 4 fp32) of it, so one warp instruction loads 32 * 16 B =
// 2 (D=128, bf16) or 4 (D=64) whole rows, fully coalesced, and there are NGRP = 128 / TPR row groups
// per CTA working on interleaved tokens. Per iteration each group takes U tokens:
//   1. The K and V vectors of the *next* iteration's U tokens are issued before the current ones are
//      used (register double-buffering): 2*U 16-byte loads in flight per thread during the math,
//      plus several CTAs per SM, keep the memory pipe full.
//   2. q.k partial dot products over the thread's VEC dims for all GP heads, then a butterfly
//      __shfl_xor over the TPR lanes of the group (log2(TPR) steps) gives every lane the full score.
//   3. Online softmax (running max m, running sum l, fp32 accumulator acc[GP][VEC]) per group, in
//      the log2 domain; then acc += p * v with the V vector already in registers.
// No __syncthreads in the main loop: groups are independent. At the end the NGRP partial states are
// merged through shared memory (rescale by exp2(m_r - max m)), and the CTA writes either the final
// output (kDirect) or a normalized partial output + its log2-sum-exp to the fp32 workspace.
// Block-table lookups are per token (t / block_size), so any block size and any (shuffled) block
// order works; the lookups hit L1/L2 (M int32 per sequence).
//
// ---- Reduce pass ---------------------------------------------------------------------------------
// grid = (Hq, B), D threads: out = sum_s 2^(lse_s - LSE) * o_s with LSE = log2 sum_s 2^lse_s; reads
// num_used_splits * D fp32 per head, small next to the K/V read when chunks are >= kMinChunk tokens.
// Fused reduce (p.split_counters set): no second kernel. Each split CTA, after writing its partial
// state, fences (__threadfence: its writes are visible device-wide before its arrival is) and
// counts itself in split_counters[b * Hq + kvh] with one atomicAdd; the CTA that arrives last
// (count == the row's used splits) reads every split's state through L2 (__ldcg) and writes the
// output with the reduce pass's arithmetic, in its order, then resets the counter to 0, so the
// counters are zero between launches (and across CUDA-graph replays) without a memset. This saves
// the reduce launch (~2-3 us inside a graph) where latency, not bandwidth, bounds a step: small
// batches, short contexts. Empty splits neither count nor wait; split 0 of a padded row (L <= 0)
// writes its zeros itself.
//
// ---- CUDA graphs ---------------------------------------------------------------------------------
// No allocation, no host sync; the workspace is caller-provided and sized [B_max, Hq, S_max, D].
// Padded batch rows use seq_len 0 and get out = 0.
// Light headers only (at::Tensor + c10 CUDA helpers): the full torch/extension.h costs minutes of
// host compile time per file.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
//
// ---- Files ---------------------------------------------------------------------------------------
// This header holds the kernels and their launch dispatch; decode_attention_{bf16,fp16,fp32}.cu
// each instantiate `decode_dispatch<T>` for one dtype (the kernels of one dtype per translation
// unit, so the three compile in parallel), and decode_attention.cu holds the op entry point, which
// checks its tensors and calls the instantiation of the query's dtype.
#pragma once

#include <c10/cuda/CUDAStream.h>

#include "common.cuh"
#include "ops.h"


namespace ferrobatch {
namespace decode {

constexpr int kDecodeThreads = 128;
constexpr int kMinChunk = 128;  // tokens: smallest KV split worth a CTA + its reduce traffic
constexpr int kChunkAlign = 64;

__host__ __device__ __forceinline__ int decode_chunk(int seq_len, int num_splits) {
  int c = (seq_len + num_splits - 1) / num_splits;
  c = c < kMinChunk ? kMinChunk : c;
  return (c + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
}

struct DecodeParams {
  void* out;                 // [B, Hq, D] contiguous
  const void* q;             // [B, Hq, D] strided
  const void* kv;            // [2, NB, BS, Hkv, D] strided
  const int32_t* block_tables;
  const int32_t* seq_lens;
  float* partial_out;        // [B_ws, Hq, S_max, D]
  float* partial_lse;        // [B_ws, Hq, S_max]
  int32_t* split_counters;   // [>= B * Hq], zero between launches: fused reduce; null: reduce pass
  int64_t q_stride_tok, q_stride_head;
  int64_t kv_stride_kv, kv_stride_block, kv_stride_tok, kv_stride_head;
  int64_t bt_stride;
  int num_heads, group, block_size, num_splits, max_splits;
  int block_shift;  // log2(block_size) when it is a power of two (the usual case), else -1
  float scale_log2;
};

namespace {

template <typename T, int D, int GP, bool kDirect>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_kernel(const DecodeParams p) {
  constexpr int VEC = Vec<T>::kElems;
  constexpr int TPR = D / VEC;                    // threads per K/V row
  static_assert(TPR >= 1 && TPR <= 32 && (32 % TPR) == 0, "row group must tile a warp");
  constexpr int NGRP = kDecodeThreads / TPR;      // row groups per CTA
  constexpr int U = GP >= 8 ? 2 : 4;              // tokens per group per iteration
  constexpr int STEP = NGRP * U;                  // tokens per CTA per iteration

  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid % TPR;
  const int grp = tid / TPR;
  const int G = p.group;
  const int L = p.seq_lens[b];

  const int chunk = decode_chunk(L > 0 ? L : 1, p.num_splits);
  const int start = split * chunk;
  const int end = min(L, start + chunk);
  if (start >= end) {
    // Empty split. In direct mode (num_splits == 1) that means L <= 0: a padded row, output 0.
    // In split mode the reduce (pass or fused) ignores unused splits; the reduce pass zero-fills
    // L <= 0 rows, with the fused reduce split 0 does.
    if (kDirect || (p.split_counters != nullptr && split == 0)) {
      T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.num_heads + kvh * G) * D;
      for (int i = tid; i < G * D; i += kDecodeThreads) out[i] = from_float<T>(0.f);
    }
    return;
  }

  // ---- query: this thread's VEC dims of each of the G heads, pre-scaled into the log2 domain.
  float q[GP][VEC];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    if (g < G) {
      const T* qp = static_cast<const T*>(p.q) + b * p.q_stride_tok +
                    (kvh * G + g) * p.q_stride_head + lane * VEC;
      unpack<T>(load_ro16(qp), q[g]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) q[g][i] *= p.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) q[g][i] = 0.f;
    }
  }

  float m[GP], l[GP], acc[GP][VEC];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  }

  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.kv) + kvh * p.kv_stride_head + lane * VEC;
  const int64_t v_off = p.kv_stride_kv;
  const int bs = p.block_size;

  // Issue the K and V loads of the U tokens of this group starting at `base` (masked past `end`).
  auto issue = [&](int base, uint4 (&kr)[U], uint4 (&vr)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + u * NGRP + grp;
      if (t < end) {
        const int bi = p.block_shift >= 0 ? (t >> p.block_shift) : t / bs;  // uniform branch
        const int64_t row = static_cast<int64_t>(bt[bi]) * p.kv_stride_block +
                            static_cast<int64_t>(t - bi * bs) * p.kv_stride_tok;
        kr[u] = load_kv16(kbase + row);
        vr[u] = load_kv16(kbase + row + v_off);
      } else {
        kr[u] = make_uint4(0u, 0u, 0u, 0u);
        vr[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };

  uint4 kn[U], vn[U];
  issue(start, kn, vn);
  for (int base = start; base < end; base += STEP) {  // CTA-uniform trip count
    uint4 kc[U], vc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kc[u] = kn[u];
      vc[u] = vn[u];
    }
    if (base + STEP < end) issue(base + STEP, kn, vn);  // prefetch the next iteration

    // scores s[u][g] = q_g . k_u (log2 domain)
    float s[U][GP];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      unpack<T>(kc[u], kf);
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) d = fmaf(q[g][i], kf[i], d);
        s[u][g] = d;
      }
    }
#pragma unroll
    for (int off = TPR / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int g = 0; g < GP; ++g) s[u][g] += __shfl_xor_sync(kFullMask, s[u][g], off);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * NGRP + grp >= end) {
#pragma unroll
        for (int g = 0; g < GP; ++g) s[u][g] = -INFINITY;
      }
    }

    // online softmax: new running max, rescale the old state once per iteration
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][g]);
      if (mx != m[g]) {  // mx > m[g], mx finite
        const float alpha = exp2f(m[g] - mx);  // m[g] == -inf -> 0
        l[g] *= alpha;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] *= alpha;
        m[g] = mx;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[VEC];
      unpack<T>(vc[u], vf);
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        const float pr = s[u][g] == -INFINITY ? 0.f : exp2f(s[u][g] - m[g]);
        l[g] += pr;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(pr, vf[i], acc[g][i]);
      }
    }
  }

  // ---- merge the NGRP row-group states of this CTA
  __shared__ float sm_m[NGRP][GP];
  __shared__ float sm_l[NGRP][GP];
  __shared__ __align__(16) float sm_acc[NGRP][GP][D];
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      sm_m[grp][g] = m[g];
      sm_l[grp][g] = l[g];
    }
  }
#pragma unroll
  for (int g = 0; g < GP; ++g) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4)
      *reinterpret_cast<float4*>(&sm_acc[grp][g][lane * VEC + i]) =
          make_float4(acc[g][i], acc[g][i + 1], acc[g][i + 2], acc[g][i + 3]);
  }
  __syncthreads();

  const int64_t head0 = static_cast<int64_t>(b) * p.num_heads + kvh * G;
  for (int idx = tid; idx < G * D; idx += kDecodeThreads) {
    const int g = idx / D;
    const int d = idx - g * D;
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < NGRP; ++r) mx = fmaxf(mx, sm_m[r][g]);
    float lsum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int r = 0; r < NGRP; ++r) {
        const float w = exp2f(sm_m[r][g] - mx);
        lsum = fmaf(sm_l[r][g], w, lsum);
        o = fmaf(sm_acc[r][g][d], w, o);
      }
    }
    const float val = lsum > 0.f ? o / lsum : 0.f;
    if (kDirect) {
      static_cast<T*>(p.out)[(head0 + g) * D + d] = from_float<T>(val);
    } else {
      const int64_t row = (head0 + g) * p.max_splits + split;
      p.partial_out[row * D + d] = val;
      if (d == 0) p.partial_lse[row] = lsum > 0.f ? mx + log2f(lsum) : -INFINITY;
    }
  }
  if (kDirect || p.split_counters == nullptr) return;

  // ---- fused reduce: the last split CTA of (b, kvh) to arrive combines all of them
  __shared__ int sm_last;
  __threadfence();
  __syncthreads();
  int32_t* counter = p.split_counters + static_cast<int64_t>(b) * p.num_heads + kvh;
  const int used = ceil_div(L, chunk);
  if (tid == 0) sm_last = atomicAdd(counter, 1) == used - 1;
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  for (int idx = tid; idx < G * D; idx += kDecodeThreads) {
    const int g = idx / D;
    const int d = idx - g * D;
    const int64_t row0 = (head0 + g) * p.max_splits;
    float mx = -INFINITY;
    for (int s2 = 0; s2 < used; ++s2) mx = fmaxf(mx, __ldcg(p.partial_lse + row0 + s2));
    float wsum = 0.f, o = 0.f;
    for (int s2 = 0; s2 < used; ++s2) {
      const float w = exp2f(__ldcg(p.partial_lse + row0 + s2) - mx);
      wsum += w;
      o = fmaf(w, __ldcg(p.partial_out + (row0 + s2) * D + d), o);
    }
    static_cast<T*>(p.out)[(head0 + g) * D + d] = from_float<T>(o / wsum);
  }
  if (tid == 0) *counter = 0;
}

template <typename T, int D>
__global__ void __launch_bounds__(D) paged_decode_reduce_kernel(const DecodeParams p) {
  const int hq = blockIdx.x;
  const int b = blockIdx.y;
  const int d = threadIdx.x;
  const int L = p.seq_lens[b];
  const int64_t head = static_cast<int64_t>(b) * p.num_heads + hq;
  T* out = static_cast<T*>(p.out) + head * D;
  if (L <= 0) {
    out[d] = from_float<T>(0.f);
    return;
  }
  const int n = ceil_div(L, decode_chunk(L, p.num_splits));  // splits that had work
  const float* lse = p.partial_lse + head * p.max_splits;
  const float* po = p.partial_out + head * p.max_splits * D + d;
  float mx = -INFINITY;
  for (int s = 0; s < n; ++s) mx = fmaxf(mx, lse[s]);
  float wsum = 0.f, o = 0.f;
  for (int s = 0; s < n; ++s) {
    const float w = exp2f(lse[s] - mx);
    wsum += w;
    o = fmaf(w, po[s * D], o);
  }
  out[d] = from_float<T>(o / wsum);
}

template <typename T, int D, int GP>
void launch_decode(const DecodeParams& p, int B, int Hkv, int Hq, cudaStream_t stream) {
  const dim3 grid(p.num_splits, Hkv, B);
  if (p.num_splits == 1) {
    paged_decode_kernel<T, D, GP, true><<<grid, kDecodeThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    paged_decode_kernel<T, D, GP, false><<<grid, kDecodeThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (p.split_counters == nullptr) {
      paged_decode_reduce_kernel<T, D><<<dim3(Hq, B), D, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

template <typename T, int D>
void dispatch_group(const DecodeParams& p, int B, int Hkv, int Hq, cudaStream_t stream) {
  const int G = p.group;
  if (G == 1) launch_decode<T, D, 1>(p, B, Hkv, Hq, stream);
  else if (G == 2) launch_decode<T, D, 2>(p, B, Hkv, Hq, stream);
  else if (G <= 4) launch_decode<T, D, 4>(p, B, Hkv, Hq, stream);
  else launch_decode<T, D, 8>(p, B, Hkv, Hq, stream);
}

template <typename T>
void dispatch_dim(const DecodeParams& p, int D, int B, int Hkv, int Hq, cudaStream_t stream) {
  if (D == 64) dispatch_group<T, 64>(p, B, Hkv, Hq, stream);
  else dispatch_group<T, 128>(p, B, Hkv, Hq, stream);
}

}  // namespace

// Launches the decode kernel (and its reduce pass when p.num_splits > 1 and the reduce is not
// fused) for dtype T.
template <typename T>
void decode_dispatch(const DecodeParams& p, int D, int B, int Hkv, int Hq, cudaStream_t stream) {
  dispatch_dim<T>(p, D, B, Hkv, Hq, stream);
}

extern template void decode_dispatch<__nv_bfloat16>(const DecodeParams&, int, int, int, int, cudaStream_t);
extern template void decode_dispatch<__half>(const DecodeParams&, int, int, int, int, cudaStream_t);
extern template void decode_dispatch<float>(const DecodeParams&, int, int, int, int, cudaStream_t);

}  // namespace decode
}  // namespace ferrobatch
