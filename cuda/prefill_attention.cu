// Causal attention for prefill chunks (and mixed prefill + decode batches) over the paged KV cache.
//
// ---- Semantics -------------------------------------------------------------------------------
// The flat batch holds B sequences; sequence b's q_len = query_start_loc[b+1] - query_start_loc[b]
// query tokens are its *last* q_len positions: query i sits at absolute position
// pos = seq_lens[b] - q_len + i and attends keys [0, pos] of that sequence, read from the paged
// cache through block_tables (the new tokens' K/V were written by reshape_and_cache first). So one
// kernel serves a fresh prompt (no prior context), a later chunk of a chunked prefill or a
// prefix-cache hit (prior context in the cache) and decode tokens (q_len = 1).
//
// ---- Design (correctness-first SIMT version) -------------------------------------------------
// grid = (ceil(max_query_len / QT), Hkv, B); CTAs whose query tile starts past q_len exit at once.
// One CTA = QT query tokens x all GP query heads of one KV head = R = 64 "rows" (QT = 64 / GP), so
// a K/V tile loaded into shared memory is used by every query head of the group (GQA reuse).
// 128 threads: thread (r, half) = (tid / 2, tid % 2) owns row r; for a KV tile of KT = 32 keys it
// computes the 16 scores of the columns half, half+2, ..., then (after a per-row max/sum exchange
// with its partner lane) accumulates P @ V for half of the head dims (float4 chunks half, half+2,
// ...). FlashAttention-2 style online softmax in fp32, log2 domain. Shared memory (dynamic):
// Q [R][D+4], K and V [KT][D+4] as fp32 (the +4 float pad spreads rows of a warp across banks for the
// 16-byte reads), P [R][KT+1]. The KV loop stops at the causal limit of the tile's last query.
//
// What bounds it: the inner products run on the FP32 pipes from shared memory (about 4 FMAs per
// 16-byte shared load), not on tensor cores. That is a fraction of what wgmma/mma.sync would give for
// long prompts; it is right for chunked-prefill sizes and small models, and it is the oracle-checked
// baseline that a tensor-core version (mma.sync m16n8k16 bf16 or sm_90a wgmma, K/V tiles via
// cp.async / TMA) should replace. Decode tokens that ride in a mixed batch waste rows (one query
// token per sequence fills GP of the 64 rows), so the CUDA backend sends the decode rows of a mixed
// batch to decode_attention.cu and only the prefill sequences here (`seq_ids` selects them: the
// grid's z index maps through it, and only the selected sequences' rows of `out` are written).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.cuh"
#include "ops.h"

namespace ferrobatch {
namespace {

constexpr int kPrefillThreads = 128;
constexpr int kRows = 64;  // query rows (token x head) per CTA
constexpr int kKT = 32;    // keys per shared-memory tile

struct PrefillParams {
  void* out;
  const void* q;
  const void* kv;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const int32_t* seq_ids;  // optional: blockIdx.z -> sequence index (a subset of the batch)
  int64_t q_stride_tok, q_stride_head;
  int64_t o_stride_tok, o_stride_head;
  int64_t kv_stride_kv, kv_stride_block, kv_stride_tok, kv_stride_head;
  int64_t bt_stride;
  int group, block_size;
  int block_shift;  // log2(block_size) when a power of two, else -1
  float scale_log2;
};

template <int D>
constexpr int prefill_smem_floats() {
  return kRows * (D + 4) + 2 * kKT * (D + 4) + kRows * (kKT + 1);
}

template <typename T, int D, int GP>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_kernel(const PrefillParams p) {
  constexpr int VEC = Vec<T>::kElems;
  constexpr int NV = D / VEC;  // 16-byte vectors per row
  constexpr int DP = D + 4;    // padded fp32 row pitch
  constexpr int PP = kKT + 1;  // padded P row pitch
  constexpr int QT = kRows / GP;
  static_assert(kPrefillThreads == 2 * kRows, "two threads per row");

  extern __shared__ float4 smem_f4[];
  float* sQ = reinterpret_cast<float*>(smem_f4);
  float* sK = sQ + kRows * DP;
  float* sV = sK + kKT * DP;
  float* sP = sV + kKT * DP;

  const int qtile = blockIdx.x;
  const int kvh = blockIdx.y;
  const int b = p.seq_ids != nullptr ? p.seq_ids[blockIdx.z] : static_cast<int>(blockIdx.z);
  const int tid = threadIdx.x;
  const int G = p.group;

  const int q0 = p.query_start_loc[b];
  const int q_len = p.query_start_loc[b + 1] - q0;
  const int qi_begin = qtile * QT;
  if (qi_begin >= q_len) return;
  const int qi_end = min(q_len, qi_begin + QT);
  const int L = p.seq_lens[b];
  const int prior = L - q_len;  // absolute position of query 0

  // ---- Q tile -> shared (fp32, pre-scaled into the log2 domain); invalid rows are zero.
  for (int idx = tid; idx < kRows * NV; idx += kPrefillThreads) {
    const int r = idx / NV;
    const int c = (idx - r * NV) * VEC;
    const int qi = qi_begin + r / GP;
    const int g = r % GP;
    float f[VEC];
    if (qi < qi_end && g < G) {
      const T* src = static_cast<const T*>(p.q) + static_cast<int64_t>(q0 + qi) * p.q_stride_tok +
                     (kvh * G + g) * p.q_stride_head + c;
      unpack<T>(load_ro16(src), f);
#pragma unroll
      for (int i = 0; i < VEC; ++i) f[i] *= p.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) f[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < VEC; i += 4)
      *reinterpret_cast<float4*>(&sQ[r * DP + c + i]) = make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]);
  }

  const int r = tid >> 1;
  const int half = tid & 1;
  const int my_qi = qi_begin + r / GP;
  const int my_g = r % GP;
  const bool row_valid = my_qi < qi_end && my_g < G;
  const int my_pos = prior + my_qi;  // keys [0, my_pos] are visible

  float acc[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
  float m = -INFINITY, l = 0.f;

  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kv = static_cast<const T*>(p.kv) + kvh * p.kv_stride_head;
  const int kv_end = min(L, prior + qi_end);  // causal limit of the tile's last query

  for (int kv0 = 0; kv0 < kv_end; kv0 += kKT) {  // CTA-uniform
    __syncthreads();  // previous tile's sK/sV (and, first time, nothing) no longer read
    for (int idx = tid; idx < kKT * NV; idx += kPrefillThreads) {
      const int kt = idx / NV;
      const int c = (idx - kt * NV) * VEC;
      const int t = kv0 + kt;
      float kf[VEC], vf[VEC];
      if (t < kv_end) {
        const int bi = p.block_shift >= 0 ? (t >> p.block_shift) : t / p.block_size;
        const T* row = kv + static_cast<int64_t>(bt[bi]) * p.kv_stride_block +
                       static_cast<int64_t>(t - bi * p.block_size) * p.kv_stride_tok + c;
        // load_ro16, not the decode kernel's evict-first load_kv16: every query tile of a
        // sequence re-reads its K/V, so these lines should stay in L2.
        unpack<T>(load_ro16(row), kf);
        unpack<T>(load_ro16(row + p.kv_stride_kv), vf);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) kf[i] = vf[i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < VEC; i += 4) {
        *reinterpret_cast<float4*>(&sK[kt * DP + c + i]) = make_float4(kf[i], kf[i + 1], kf[i + 2], kf[i + 3]);
        *reinterpret_cast<float4*>(&sV[kt * DP + c + i]) = make_float4(vf[i], vf[i + 1], vf[i + 2], vf[i + 3]);
      }
    }
    __syncthreads();  // Q (first tile) and this K/V tile visible

    // ---- scores for columns half + 2j
    float s[kKT / 2];
#pragma unroll
    for (int j = 0; j < kKT / 2; ++j) s[j] = 0.f;
#pragma unroll 4
    for (int d = 0; d < D; d += 4) {
      const float4 qv = *reinterpret_cast<const float4*>(&sQ[r * DP + d]);
#pragma unroll
      for (int j = 0; j < kKT / 2; ++j) {
        const float4 kv4 = *reinterpret_cast<const float4*>(&sK[(half + 2 * j) * DP + d]);
        s[j] = fmaf(qv.x, kv4.x, fmaf(qv.y, kv4.y, fmaf(qv.z, kv4.z, fmaf(qv.w, kv4.w, s[j]))));
      }
    }

    // ---- causal mask + online softmax (row state shared by lanes 2r, 2r+1 of one warp)
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKT / 2; ++j) {
      const int t = kv0 + half + 2 * j;
      if (!row_valid || t > my_pos || t >= kv_end) s[j] = -INFINITY;
      mx = fmaxf(mx, s[j]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    const float m_new = fmaxf(m, mx);
    const float alpha = m_new == -INFINITY ? 1.f : exp2f(m - m_new);
    float psum = 0.f;
#pragma unroll
    for (int j = 0; j < kKT / 2; ++j) {
      const float pj = s[j] == -INFINITY ? 0.f : exp2f(s[j] - m_new);
      psum += pj;
      sP[r * PP + half + 2 * j] = pj;
    }
    psum += __shfl_xor_sync(kFullMask, psum, 1);
    l = l * alpha + psum;
    m = m_new;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] *= alpha;
    __syncwarp();  // row r's P is written by lanes 2r and 2r+1 of this warp only

    // ---- acc += P[r, :] @ V[:, my dims]
#pragma unroll 2
    for (int kt = 0; kt < kKT; ++kt) {
      const float pk = sP[r * PP + kt];
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const float4 v4 = *reinterpret_cast<const float4*>(&sV[kt * DP + 4 * (half + 2 * i)]);
        acc[4 * i] = fmaf(pk, v4.x, acc[4 * i]);
        acc[4 * i + 1] = fmaf(pk, v4.y, acc[4 * i + 1]);
        acc[4 * i + 2] = fmaf(pk, v4.z, acc[4 * i + 2]);
        acc[4 * i + 3] = fmaf(pk, v4.w, acc[4 * i + 3]);
      }
    }
  }

  if (row_valid) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* o = static_cast<T*>(p.out) + static_cast<int64_t>(q0 + my_qi) * p.o_stride_tok +
           (kvh * G + my_g) * p.o_stride_head;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[4 * (half + 2 * i) + e] = from_float<T>(acc[4 * i + e] * inv);
    }
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int block_shift_of(int block_size) {
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -1;
  int shift = 0;
  while ((1 << shift) < block_size) ++shift;
  return shift;
}

template <typename T, int D, int GP>
void launch_prefill(const PrefillParams& p, int B, int Hkv, int64_t max_query_len,
                    cudaStream_t stream) {
  constexpr int QT = kRows / GP;
  const int64_t tiles = (max_query_len + QT - 1) / QT;
  TORCH_CHECK(tiles <= 0x7fffffff, "max_query_len too large");
  constexpr size_t smem = prefill_smem_floats<D>() * sizeof(float);
  C10_CUDA_CHECK(cudaFuncSetAttribute(paged_prefill_kernel<T, D, GP>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  paged_prefill_kernel<T, D, GP>
      <<<dim3(static_cast<unsigned>(tiles), Hkv, B), kPrefillThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D>
void prefill_group(const PrefillParams& p, int B, int Hkv, int64_t mql, cudaStream_t s) {
  const int G = p.group;
  if (G == 1) launch_prefill<T, D, 1>(p, B, Hkv, mql, s);
  else if (G == 2) launch_prefill<T, D, 2>(p, B, Hkv, mql, s);
  else if (G <= 4) launch_prefill<T, D, 4>(p, B, Hkv, mql, s);
  else launch_prefill<T, D, 8>(p, B, Hkv, mql, s);
}

template <typename T>
void prefill_dim(const PrefillParams& p, int D, int B, int Hkv, int64_t mql, cudaStream_t s) {
  if (D == 64) prefill_group<T, 64>(p, B, Hkv, mql, s);
  else prefill_group<T, 128>(p, B, Hkv, mql, s);
}

}  // namespace

void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, double scale,
                             int64_t max_query_len, const std::optional<at::Tensor>& seq_ids) {
  TORCH_CHECK(q.is_cuda() && out.is_cuda() && kv_cache.is_cuda() && block_tables.is_cuda() &&
                  seq_lens.is_cuda() && query_start_loc.is_cuda(),
              "paged_prefill_attention: all tensors must be on CUDA");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && out.sizes() == q.sizes(),
              "q and out must be [T, Hq, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, Hkv, D]");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D, "head_dim of q and kv_cache differ");
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128, got ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t G = Hq / Hkv;
  TORCH_CHECK(G <= 8, "GQA ratio > 8 is not supported by the CUDA prefill kernel");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and kv_cache must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(4) == 1,
              "head_dim must be contiguous");
  const int vec = 16 / static_cast<int>(q.element_size());
  TORCH_CHECK(q.stride(0) % vec == 0 && q.stride(1) % vec == 0 && aligned16(q.data_ptr()),
              "q rows must be 16-byte aligned");
  for (int d = 0; d < 4; ++d)
    TORCH_CHECK(kv_cache.stride(d) % vec == 0, "kv_cache strides must be 16-byte multiples");
  TORCH_CHECK(aligned16(kv_cache.data_ptr()), "kv_cache must be 16-byte aligned");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) >= 1,
              "query_start_loc must be contiguous int32 [B+1]");
  const int64_t B = query_start_loc.size(0) - 1;
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) >= B && block_tables.stride(1) == 1,
              "block_tables must be int32 [>=B, M] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) >= B &&
                  seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 [>=B]");
  int64_t grid_z = B;
  if (seq_ids.has_value()) {
    const at::Tensor& ids = *seq_ids;
    TORCH_CHECK(ids.is_cuda() && ids.scalar_type() == at::kInt && ids.dim() == 1 &&
                    ids.is_contiguous(),
                "seq_ids must be a contiguous int32 CUDA tensor");
    grid_z = ids.size(0);  // values must lie in [0, B): not checked on the host (no sync)
  }
  TORCH_CHECK(grid_z <= 65535, "too many sequences for gridDim.z");
  if (grid_z == 0 || q.size(0) == 0 || max_query_len <= 0) return;

  const c10::cuda::CUDAGuard guard(q.device());
  PrefillParams p;
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.seq_ids = seq_ids.has_value() ? seq_ids->data_ptr<int32_t>() : nullptr;
  p.q_stride_tok = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.o_stride_tok = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.kv_stride_kv = kv_cache.stride(0);
  p.kv_stride_block = kv_cache.stride(1);
  p.kv_stride_tok = kv_cache.stride(2);
  p.kv_stride_head = kv_cache.stride(3);
  p.bt_stride = block_tables.stride(0);
  p.group = static_cast<int>(G);
  p.block_size = static_cast<int>(kv_cache.size(2));
  p.block_shift = block_shift_of(p.block_size);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int iB = static_cast<int>(grid_z), iHkv = static_cast<int>(Hkv), iD = static_cast<int>(D);
  switch (q.scalar_type()) {
    case at::kBFloat16: prefill_dim<__nv_bfloat16>(p, iD, iB, iHkv, max_query_len, stream); break;
    case at::kHalf: prefill_dim<__half>(p, iD, iB, iHkv, max_query_len, stream); break;
    case at::kFloat: prefill_dim<float>(p, iD, iB, iHkv, max_query_len, stream); break;
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace ferrobatch
