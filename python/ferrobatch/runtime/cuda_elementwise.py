"""The Llama layer's elementwise modules on CUDA as ferrobatch's fused kernels (``cuda/elementwise.cu``):
RMSNorm in one kernel instead of ~8 (with the residual add before it in the same kernel:
``llama.add_then_norm``), SiLU-and-mul in one instead of 2, rotary embedding of q and k in place
in one instead of ~10, and (``rotate_and_cache``) the rotation together with the K/V write into
the paged cache in one kernel instead of two. Inside a CUDA graph each launch costs ~2 us, so on the H200 a
decode step of SmolLM2-135M (30 layers, ~35 launches each) spends more on launches than on its
arithmetic. The kernels round where torch's eager ops round (see the .cu header).

On CUDA ``ModelRunner`` swaps them in (``swap_cuda_elementwise_ops``) once a start-up check
(``check_fused_ops``: each kernel against the module it replaces, on random inputs of the model's
shapes and layouts) agrees; otherwise, with the check's finding in the log, the model keeps
torch's modules. ``FERROBATCH_CUDA_FUSED_OPS=0`` keeps them too. The rotary + K/V write kernel
has a start-up check of its own (``check_rotary_cache``); if it fails, or with
``FERROBATCH_ROTARY_CACHE=0``, rotary and the write stay two kernels (the choice is the
attention backend's ``rotary_with_kv_write``, per ModelRunner). ``tests/gpu/test_elementwise.py``
checks the kernels more widely. (Written in sessions 29-30 without a GPU: the check is what
stands between them and a wrong result until that test has run.)
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ferrobatch.model.llama import RMSNorm, SiluAndMul
from ferrobatch.model.rope import ApplyRotary
from ferrobatch.runtime import cuda_ops

ENV_FLAG = "FERROBATCH_CUDA_FUSED_OPS"
ROTARY_CACHE_FLAG = "FERROBATCH_ROTARY_CACHE"


def fused_ops_requested() -> bool:
    """False when ``FERROBATCH_CUDA_FUSED_OPS=0`` keeps torch's elementwise modules."""
    return os.environ.get(ENV_FLAG, "1") != "0"


def rotary_cache_requested() -> bool:
    """False when ``FERROBATCH_ROTARY_CACHE=0`` keeps rotary and the K/V write two kernels."""
    return os.environ.get(ROTARY_CACHE_FLAG, "1") != "0"


class CudaRMSNorm(nn.Module):
    """``RMSNorm`` in one kernel; shares the replaced module's weight."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))`` in one kernel (``llama.add_then_norm``)."""
        return cuda_ops.add_rms_norm(x, delta, self.weight, self.eps)


class CudaSiluAndMul(nn.Module):
    """``SiluAndMul`` in one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_ops.silu_and_mul(x)


class CudaApplyRotary(nn.Module):
    """``ApplyRotary`` in one kernel, rotating ``query`` and ``key`` in place (returns them);
    ``rotate_and_cache`` also stores the rotated keys and the values in the paged KV cache in
    the same kernel (``LlamaAttention.attend`` uses it where the backend allows)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = tables          # [T, 1, D], the model's dtype
        cuda_ops.rotary_inplace(query, key, cos.reshape(cos.shape[0], -1),
                                sin.reshape(sin.shape[0], -1))
        return query, key

    def rotate_and_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         tables: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> bool:
        """Rotates ``query`` / ``key`` in place and writes ``key`` / ``value`` into ``kv_cache``
        at ``slot_mapping`` (-1 skips a row), in one kernel. False, having done nothing, when
        the cache's dtype is not the query's (the caller then rotates and writes apart)."""
        if kv_cache.dtype != query.dtype:
            return False
        cos, sin = tables
        cuda_ops.rotary_and_cache(query, key, value, cos.reshape(cos.shape[0], -1),
                                  sin.reshape(sin.shape[0], -1), kv_cache, slot_mapping)
        return True


def swap_cuda_elementwise_ops(model: nn.Module) -> int:
    """Replaces every RMSNorm / SiluAndMul / ApplyRotary of ``model`` (on CUDA) by its fused
    kernel; returns how many modules were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is RMSNorm:
                new = CudaRMSNorm(child)
            elif type(child) is SiluAndMul:
                new = CudaSiluAndMul()
            elif type(child) is ApplyRotary:
                new = CudaApplyRotary()
            else:
                continue
            setattr(parent, name, new)
            replaced += 1
    return replaced


def check_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` of the start-up checks: the GPU tests' (1e-5 in float32, 8e-3 in bf16 /
    fp16, where a summation order may move a rounding)."""
    return (1e-5, 1e-5) if dtype == torch.float32 else (8e-3, 8e-3)


def tolerance_violation(got: torch.Tensor, want: torch.Tensor, rtol: float,
                        atol: float) -> float:
    """max |got - want| / (atol + rtol |want|): <= 1 where ``torch.testing.assert_close`` passes."""
    got, want = got.double(), want.double()
    return float(((got - want).abs() / (atol + rtol * want.abs())).max())


@torch.no_grad()
def check_fused_ops(model: nn.Module, dtype: torch.dtype) -> tuple[bool, str]:
    """Each fused kernel against the module it replaces in ``model`` (on its CUDA device, before
    the swap), on random inputs of the model's shapes: strided rows for the norms (with and
    without the residual add), strided q / k views of a fused QKV output for rotary, the model's
    own rotary tables. ``(agree, what was found)``; the tolerance is the GPU tests' (1e-5 in
    float32, 8e-3 in bf16 / fp16: the mean square's summation order may move a rounding)."""
    from ferrobatch.model.llama import add_then_norm

    cfg = model.config
    device = model.embed_tokens.weight.device
    tol = check_tolerance(dtype)
    gen = torch.Generator(device="cpu").manual_seed(1234)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    rows, hidden = 37, cfg.hidden_size
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    try:
        norm = model.layers[0].post_attention_layernorm
        fused = CudaRMSNorm(norm)
        wide = rand(rows, 2 * hidden + 8, scale=3.0)
        x, delta = wide[:, :hidden], wide[:, hidden + 8:]
        pairs = {"rms_norm": (fused(x), norm(x))}
        (got_sum, got), (want_sum, want) = (add_then_norm(fused, x, delta),
                                            add_then_norm(norm, x, delta))
        pairs["add_rms_norm sum"], pairs["add_rms_norm"] = (got_sum, want_sum), (got, want)
        gate_up = rand(rows, 2 * cfg.intermediate_size, scale=4.0)
        pairs["silu_and_mul"] = (CudaSiluAndMul()(gate_up), SiluAndMul()(gate_up))
        positions = torch.randint(0, cfg.max_position_embeddings, (rows,), generator=gen)
        tables = model.rotary.tables(positions.to(device), dtype)
        qkv = rand(rows, (heads + 2 * kv_heads) * dim)
        q = qkv[:, :heads * dim].view(rows, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
        want_q, want_k = (t.clone() for t in ApplyRotary()(q, k, tables))
        got_q, got_k = CudaApplyRotary()(q, k, tables)
        pairs["rotary q"], pairs["rotary k"] = (got_q, want_q), (got_k, want_k)
        worst = {name: tolerance_violation(g, w, *tol) for name, (g, w) in pairs.items()}
    except Exception as exc:  # noqa: BLE001 - any failure means: keep torch's modules
        return False, f"{type(exc).__name__}: {exc}"
    name = max(worst, key=worst.get)
    detail = f"worst {name}: {worst[name]:.2f} of the tolerance"
    return all(v <= 1.0 for v in worst.values()), detail


@torch.no_grad()
def check_rotary_cache(model: nn.Module, dtype: torch.dtype) -> tuple[bool, str]:
    """The rotary + K/V write kernel against torch's ``ApplyRotary`` and an indexed store, on
    random inputs of the model's shapes (strided q / k / v views of a fused QKV output, the
    model's rotary tables, shuffled slots over several blocks, one padding row with slot -1),
    before the swap: q, k and the written cache rows within the tolerance of ``check_fused_ops``,
    and every other cache element exactly as it was. ``(agree, what was found)``."""
    cfg = model.config
    device = model.embed_tokens.weight.device
    tol = check_tolerance(dtype)
    gen = torch.Generator(device="cpu").manual_seed(4321)
    rows, block_size, num_blocks = 37, 16, 8
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    try:
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
        q = qkv[:, :heads * dim].view(rows, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
        positions = torch.randint(0, cfg.max_position_embeddings, (rows,), generator=gen)
        tables = model.rotary.tables(positions.to(device), dtype)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
        slots[rows // 2] = -1
        cache = torch.full((2, num_blocks, block_size, kv_heads, dim), 7.0, dtype=dtype,
                           device=device)
        want_q, want_k = (t.clone() for t in ApplyRotary()(q, k, tables))
        want_cache = cache.clone()
        real = slots >= 0
        flat = want_cache.view(2, -1, kv_heads, dim)
        flat[0, slots[real].to(device)] = want_k[real.to(device)]
        flat[1, slots[real].to(device)] = v[real.to(device)]
        if not CudaApplyRotary().rotate_and_cache(
                q, k, v, tables, cache, slots.to(device)):
            return False, "the kernel declined the check's inputs"
        written = torch.zeros(2, num_blocks * block_size, dtype=torch.bool, device=device)
        written[:, slots[real].to(device)] = True
        untouched = ~written.view(2, num_blocks, block_size)
        if not torch.equal(cache[untouched], want_cache[untouched]):
            return False, "the kernel wrote cache elements outside the step's slots"
        got_want = {"q": (q, want_q), "k": (k, want_k),
                    "cache": (cache[~untouched], want_cache[~untouched])}
        worst = {name: tolerance_violation(g, w, *tol) for name, (g, w) in got_want.items()}
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the two kernels
        return False, f"{type(exc).__name__}: {exc}"
    name = max(worst, key=worst.get)
    return all(x <= 1.0 for x in worst.values()), f"worst {name}: {worst[name]:.2f} of the tolerance"
