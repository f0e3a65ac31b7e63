"""The FlashAttention prefill path's host side, without a GPU (``runtime.attention.flash_prefill``):
the plan (query rows, the cache slot of every context token, cumulative lengths), the gather /
kernel / scatter with ``varlen_reference`` standing in for torch's FlashAttention-2 op, the
start-up check, and the CUDA backend's glue choosing between FlashAttention and ferrobatch's
kernel. tests/gpu/test_flash_prefill.py runs the same steps on the real kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cuda_glue import BLOCK_SIZE, make_step

from ferrobatch.runtime.attention import flash_prefill as flash
from ferrobatch.runtime.attention.torch_ref import TorchReferenceBackend


def _naive_plan(batch, seqs):
    """The plan's arrays written out one sequence and one token at a time."""
    qsl, lens, tables = batch.query_start_loc, batch.seq_lens, batch.block_tables
    rows, slots = [], []
    for b in seqs:
        rows += list(range(qsl[b], qsl[b + 1]))
        slots += [int(tables[b, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
                  for t in range(lens[b])]
    return rows, slots


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([5, 300], [5, 300]),                           # fresh prompts
    ([1, 7, 1, 33, 1, 2], [40, 7, 513, 200, 16, 17]),  # mixed, chunks after prior context
    ([45], [300]),                                  # one chunk after context, ends mid-block
])
def test_plan_matches_a_token_by_token_layout(query_lens, seq_lens):
    rng = np.random.default_rng(len(query_lens))
    batch, _ = make_step(rng, seq_lens, query_lens)
    ql = np.asarray(query_lens)
    seqs = np.flatnonzero(ql > 1) if (ql == 1).any() else np.arange(len(ql))
    a = flash.plan_arrays(batch.query_start_loc, batch.seq_lens, batch.block_tables, BLOCK_SIZE,
                          seqs)
    rows, slots = _naive_plan(batch, seqs)
    if len(seqs) == len(ql):
        assert a["q_rows"] is None
    else:
        assert a["q_rows"].tolist() == rows
    assert a["kv_slots"].tolist() == slots
    assert a["cu_q"].tolist() == [0, *np.cumsum(ql[seqs]).tolist()]
    assert a["cu_k"].tolist() == [0, *np.cumsum(np.asarray(seq_lens)[seqs]).tolist()]
    assert a["max_q"] == ql[seqs].max() and a["max_k"] == max(np.asarray(seq_lens)[seqs])


def _cpu(a, dt):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1), (1, 8)])
@pytest.mark.parametrize("query_lens", [[5, 300], [1, 7, 1, 33, 1, 2], [45, 1]])
def test_flash_path_matches_the_reference_backend(dtype, num_kv_heads, group, query_lens):
    """Gather + varlen kernel + scatter over a shuffled paged cache: the prefill rows equal the
    torch reference backend's; rows outside the plan (decode rows) are left untouched."""
    rng = np.random.default_rng(7 * len(query_lens) + group)
    seq_lens = [max(q, int(x)) for q, x in zip(query_lens, rng.integers(40, 700, len(query_lens)))]
    batch, num_blocks = make_step(rng, seq_lens, query_lens)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, 64, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), num_kv_heads * group, 64, generator=gen).to(dtype)
    ql = np.asarray(query_lens)
    seqs = np.flatnonzero(ql > 1) if (ql == 1).any() else np.arange(len(ql))
    plan = flash.plan_flash_prefill(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                    BLOCK_SIZE, seqs, _cpu)
    out = torch.full_like(q, float("nan"))
    flash.flash_prefill_attention(q, cache, plan, 0.125, out=out, attn=flash.varlen_reference)
    ref_be = TorchReferenceBackend(BLOCK_SIZE)
    want = ref_be.forward(q.float(), cache.float(), ref_be.build_metadata(batch, "cpu"), 0.125)
    rows = np.concatenate([np.arange(batch.query_start_loc[b], batch.query_start_loc[b + 1])
                           for b in seqs])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[rows].float(), want[rows], rtol=tol, atol=tol)
    others = np.setdiff1d(np.arange(len(q)), rows)
    assert out[others].isnan().all(), "rows outside the plan were written"
    if plan.q_rows is None:          # every row: the function may also return a new tensor
        torch.testing.assert_close(
            flash.flash_prefill_attention(q, cache, plan, 0.125, attn=flash.varlen_reference),
            out)
    else:
        with pytest.raises(ValueError, match="needs `out`"):
            flash.flash_prefill_attention(q, cache, plan, 0.125, attn=flash.varlen_reference)


def _top_left_causal(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """A plausible bug: the causal mask aligned at the top left (query i sees keys 0..i)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        n, length = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        kk = k[ck[i]:ck[i + 1]].float().repeat_interleave(group, dim=1)
        vv = v[ck[i]:ck[i + 1]].float().repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,lhd->hnl", q[cq[i]:cq[i + 1]].float(), kk) * scale
        s = s.masked_fill(~(torch.arange(length)[None, :] <= torch.arange(n)[:, None])[None],
                          float("-inf"))
        out[cq[i]:cq[i + 1]] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), vv).to(q.dtype)
    return out


def _fake_kernel(backend):
    return backend.fake.paged_prefill_attention


@pytest.mark.parametrize("whole_step", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_start_up_check_accepts_the_reference_and_rejects_wrong_kernels(backend, dtype,
                                                                        whole_step):
    kernel = _fake_kernel(backend)

    def check(attn):
        return flash.check_flash_prefill(kernel, 12, 4, 64, dtype, BLOCK_SIZE,
                                         torch.device("cpu"), attn=attn, whole_step=whole_step)

    ok, detail = check(flash.varlen_reference)
    assert ok, detail
    ok, detail = check(_top_left_causal)
    assert not ok and "relative error" in detail

    def raises(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    ok, detail = check(raises)
    assert not ok and "Ampere" in detail


def _run_step(backend, query_lens, dtype, seed):
    rng = np.random.default_rng(seed)
    seq_lens = [max(q, int(x)) for q, x in zip(query_lens, rng.integers(40, 500, len(query_lens)))]
    batch, num_blocks = make_step(rng, seq_lens, query_lens)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, 2, 64, generator=gen).to(dtype)
    q, k, v = (torch.randn(sum(query_lens), h, 64, generator=gen).to(dtype) for h in (8, 2, 2))
    ref_be = TorchReferenceBackend(BLOCK_SIZE)
    meta, ref_meta = backend.build_metadata(batch, "cpu"), ref_be.build_metadata(batch, "cpu")
    ref_cache = cache.clone()
    backend.write_kv(cache, k, v, meta)
    ref_be.write_kv(ref_cache, k, v, ref_meta)
    out = backend.forward(q, cache, meta, 0.125)
    want = ref_be.forward(q.float(), ref_cache.float(), ref_meta, 0.125)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    return meta


@pytest.mark.parametrize("query_lens", [[5, 300], [1, 70, 1, 133, 1, 2]])
def test_backend_sends_bf16_steps_to_flash_after_the_check(backend, monkeypatch, query_lens):
    """bf16: the first prefill step runs the start-up check (ferrobatch's kernel and
    FlashAttention once each, on the check's own step; a mixed step planned whole has a second
    check), then every row of every step goes through one varlen call: a mixed step within
    MAX_CONTEXT_TOKENS is planned whole, its decode rows as one-query sequences."""
    used = []
    monkeypatch.setattr(flash, "varlen_flash",
                        lambda *a: used.append(1) or flash.varlen_reference(*a))
    backend.flash_prefill = True
    for seed in (1, 2):
        meta = _run_step(backend, query_lens, torch.bfloat16, seed)
        assert meta.flash_plan is not None and meta.flash_plan.q_rows is None
        assert meta.flash_plan.cu_q.tolist() == [0, *np.cumsum(query_lens).tolist()]
    assert list(backend._flash_verdicts.values()) == [True]
    checks = 2 if 1 in query_lens else 1
    assert list(backend._whole_step_verdicts.values()) == [True] * (checks - 1)
    calls = [c for c in backend.fake.calls if c != "cache"]
    assert calls == ["prefill/subset"] * checks, calls       # the checks' comparisons only
    assert len(used) == checks + 2                           # the checks + two steps


def test_the_whole_step_knob_splits_mixed_steps_as_before(backend, monkeypatch):
    """FERROBATCH_FLASH_WHOLE_STEP=0 (read at construction; the bench's `-splitmixed`): a mixed
    step's prefill sequences only, even when the whole step would fit."""
    from ferrobatch.runtime.attention.cuda import flash_whole_steps_requested

    assert flash_whole_steps_requested() and backend.flash_whole_steps
    monkeypatch.setenv("FERROBATCH_FLASH_WHOLE_STEP", "0")
    assert not flash_whole_steps_requested()
    monkeypatch.setattr(flash, "varlen_flash", flash.varlen_reference)
    backend.flash_prefill, backend.flash_whole_steps = True, False
    meta = _run_step(backend, [1, 70, 1, 133], torch.bfloat16, 13)
    assert meta.flash_plan.q_rows is not None                      # prefill rows only
    assert any(c.startswith("decode") for c in backend.fake.calls)


def test_mixed_steps_with_too_much_context_send_only_their_prefill_rows(backend, monkeypatch):
    """A mixed step whose decode rows' contexts would make the gather too big: FlashAttention
    for its prefill sequences only, the decode kernel for its decode rows."""
    used = []
    monkeypatch.setattr(flash, "varlen_flash",
                        lambda *a: used.append(1) or flash.varlen_reference(*a))
    backend.flash_prefill = True
    _run_step(backend, [5, 300], torch.bfloat16, 1)          # the start-up check passes
    backend.fake.calls.clear()
    query_lens = [1, 250, 1, 200]
    monkeypatch.setattr(flash, "MAX_CONTEXT_TOKENS", 900)
    meta = _run_step(backend, query_lens, torch.bfloat16, 12)
    lens = np.asarray(meta.seq_lens_cpu)
    assert lens.sum() > 900 >= lens[[1, 3]].sum(), "seed 12 no longer gives the intended step"
    assert meta.flash_plan.q_rows.tolist() == list(range(1, 251)) + list(range(252, 452))
    calls = [c for c in backend.fake.calls if c != "cache"]
    assert len(calls) == 1 and calls[0].startswith("decode"), calls
    assert len(used) == 3                    # the check, the first step, this step
    assert backend._whole_step_verdicts == {}                # never planned whole: no check


def test_a_failed_whole_step_check_keeps_flash_for_prefill_rows(backend, monkeypatch, caplog):
    """FlashAttention that mishandles one-query sequences: the whole-step check catches it,
    that step and the later ones split (decode rows on the decode kernel), prefill rows stay
    on FlashAttention."""
    def wrong_for_one_query(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        out = flash.varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale)
        one = torch.diff(cu_q) == 1
        out[cu_q[:-1][one].long()] = 0                      # one-query rows come out wrong
        return out

    monkeypatch.setattr(flash, "varlen_flash", wrong_for_one_query)
    backend.flash_prefill = True
    meta = _run_step(backend, [1, 70, 1, 133], torch.bfloat16, 14)   # still the right answer
    assert meta.flash_plan.q_rows is None                    # planned whole before the check
    assert list(backend._flash_verdicts.values()) == [True]
    assert list(backend._whole_step_verdicts.values()) == [False]
    assert not backend.flash_whole_steps and "not planned whole" in caplog.text
    meta = _run_step(backend, [1, 70, 1, 133], torch.bfloat16, 15)
    assert meta.flash_plan is not None and meta.flash_plan.q_rows is not None


def test_backend_falls_back_to_its_kernel_when_the_check_fails(backend, monkeypatch, caplog):
    monkeypatch.setattr(flash, "varlen_flash", _top_left_causal)
    backend.flash_prefill = True
    _run_step(backend, [5, 300], torch.bfloat16, 3)          # still the right answer
    assert list(backend._flash_verdicts.values()) == [False]
    assert "FlashAttention-2 not used" in caplog.text
    assert backend.fake.calls.count("prefill") == 1          # the step itself, on the kernel
    meta = _run_step(backend, [5, 300], torch.bfloat16, 4)
    assert meta.flash_plan is None                           # no plan once the check failed


def test_float32_and_switched_off_stay_on_ferrobatchs_kernel(backend, monkeypatch):
    monkeypatch.setattr(flash, "varlen_flash", lambda *a: pytest.fail("flash used"))
    backend.flash_prefill = True
    _run_step(backend, [5, 300], torch.float32, 5)           # FlashAttention has no fp32
    backend.flash_prefill = False
    meta = _run_step(backend, [1, 70, 133], torch.bfloat16, 6)
    assert meta.flash_plan is None and backend._flash_verdicts == {}


def test_small_prefills_stay_on_ferrobatchs_kernel(backend, monkeypatch):
    """Below MIN_QUERY_TOKENS prefill tokens a step keeps the kernel's single launch."""
    monkeypatch.setattr(flash, "varlen_flash", lambda *a: pytest.fail("flash used"))
    backend.flash_prefill = True
    small = [1, 7, 1, 33, 1, 2]
    assert sum(q for q in small if q > 1) < flash.MIN_QUERY_TOKENS
    meta = _run_step(backend, small, torch.bfloat16, 7)
    assert meta.flash_plan is None and backend._flash_verdicts == {}
    assert "prefill/subset" in backend.fake.calls


def _flaky_flash(monkeypatch, message: str) -> dict:
    """Puts a varlen kernel in place that is right until ``state["fail"]`` is set, then raises
    RuntimeError(message); returns ``state``."""
    state = {"fail": False}

    def flaky(*args):
        if state["fail"]:
            raise RuntimeError(message)
        return flash.varlen_reference(*args)

    monkeypatch.setattr(flash, "varlen_flash", flaky)
    return state


def test_a_flash_error_at_run_time_falls_back_for_good(backend, monkeypatch, caplog):
    """The check passed, then the kernel raises on a later step (a shape it rejects): that step
    still gets the right answer from ferrobatch's kernel, and FlashAttention stays off."""
    state = _flaky_flash(monkeypatch, "FlashAttention: max_seqlen_k too large")
    backend.flash_prefill = True
    _run_step(backend, [5, 300], torch.bfloat16, 8)
    assert list(backend._flash_verdicts.values()) == [True]
    state["fail"] = True
    _run_step(backend, [70, 133], torch.bfloat16, 9)
    assert list(backend._flash_verdicts.values()) == [False]
    assert "FlashAttention-2 failed" in caplog.text
    assert backend.fake.calls.count("prefill/subset") == 1      # the check's
    assert backend.fake.calls.count("prefill") == 1             # the failed step's, on the kernel
    assert _run_step(backend, [5, 300], torch.bfloat16, 10).flash_plan is None


def test_steps_with_too_much_context_to_gather_keep_the_kernel(backend, monkeypatch):
    """Prefill sequences holding more than MAX_CONTEXT_TOKENS context tokens in all: no plan
    (the gathered copy would not be in the warm-up's memory peak)."""
    monkeypatch.setattr(flash, "varlen_flash", lambda *a: pytest.fail("flash used"))
    monkeypatch.setattr(flash, "MAX_CONTEXT_TOKENS", 600)
    backend.flash_prefill = True
    meta = _run_step(backend, [1, 200, 300], torch.bfloat16, 11)    # contexts >= 200 + 300
    total = int(np.asarray(meta.seq_lens_cpu)[1:].sum())
    assert total > 600 and meta.flash_plan is None


def test_the_banner_says_where_prefill_attention_runs(backend):
    backend.flash_prefill = True
    assert "prefill: FlashAttention-2 (torch) for prefills of 128+ tokens, with the decode " \
        "rows of a mixed step" in backend.description
    backend.flash_whole_steps = False
    assert "prefill: FlashAttention-2 (torch) for prefills of 128+ tokens once" \
        in backend.description
    backend.flash_prefill = False
    assert backend.description.endswith("prefill: ferrobatch's paged prefill kernel)")


def test_a_flash_error_in_a_whole_mixed_step_falls_back_to_both_kernels(backend, monkeypatch):
    """Both checks passed, then the varlen call raises on a mixed step planned whole: that step
    gets the right answer from ferrobatch's prefill and decode kernels."""
    state = _flaky_flash(monkeypatch, "FlashAttention: out of memory")
    backend.flash_prefill = True
    _run_step(backend, [1, 70, 1, 133], torch.bfloat16, 16)
    assert list(backend._whole_step_verdicts.values()) == [True]
    backend.fake.calls.clear()
    state["fail"] = True
    meta = _run_step(backend, [1, 90, 1, 140], torch.bfloat16, 17)     # checked against torch
    assert meta.flash_plan.q_rows is None
    calls = [c for c in backend.fake.calls if c != "cache"]
    assert calls[0] == "prefill/subset" and calls[1].startswith("decode"), calls
    assert list(backend._flash_verdicts.values()) == [False]
