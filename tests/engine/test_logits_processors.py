"""Per-request logits processors: the row-level runner on random logits (arguments, chaining,
failures), the parameter checks, and on the real SmolLM2 engine against the built-in masks they
can express (allowed_token_ids, logit_bias), their history argument, n > 1, and a processor that
raises next to requests that keep going."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ferrobatch.config import EngineConfig
from ferrobatch.runtime.logits_processors import (
    apply_logits_processors,
    checked_processors,
    processor_arity,
)
from ferrobatch.runtime.sampler import RequestExtras
from ferrobatch.sampling_params import SamplingParams

VOCAB = 32


def _batch(req_ids, seq_indices=None):
    return SimpleNamespace(sample_req_ids=np.asarray(req_ids, dtype=np.uint64),
                           sample_seq_indices=np.asarray(seq_indices or [0] * len(req_ids),
                                                         dtype=np.uint32))


def _extras(*fns, prompt=(), history=None):
    return RequestExtras(prompt_token_ids=list(prompt), output_token_ids=history or [[]],
                         logits_processors=checked_processors(fns))


# -- the runner ------------------------------------------------------------------------------

def test_processors_get_their_rows_history_and_prompt_and_run_in_order():
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.normal(size=(4, VOCAB)).astype(np.float32))
    before = logits.clone()
    seen = []

    def add_one(history, row):                      # in place, returns the same row
        seen.append(("add", list(history)))
        row += 1.0
        return row

    def double(prompt, history, row):               # a new tensor
        seen.append(("double", list(prompt), list(history)))
        return row * 2.0

    extras = {7: _extras(add_one, double, prompt=[5, 6], history=[[1, 2], [3]]),
              9: _extras(double, prompt=[4])}
    # rows: request 7 seq 1, an untouched request 8, request 9, request 7 seq 0
    failures = apply_logits_processors(logits, _batch([7, 8, 9, 7], [1, 0, 0, 0]), extras)
    assert failures == {}
    torch.testing.assert_close(logits[0], (before[0] + 1.0) * 2.0)
    torch.testing.assert_close(logits[1], before[1])
    torch.testing.assert_close(logits[2], before[2] * 2.0)
    torch.testing.assert_close(logits[3], (before[3] + 1.0) * 2.0)
    assert seen == [("add", [3]), ("double", [5, 6], [3]), ("double", [4], []),
                    ("add", [1, 2]), ("double", [5, 6], [1, 2])]


def test_the_history_a_processor_gets_is_a_copy():
    def clobber(history, row):
        history.append(99)
        return row

    extras = {1: _extras(clobber, history=[[4]])}
    apply_logits_processors(torch.zeros(1, VOCAB), _batch([1]), extras)
    assert extras[1].output_token_ids == [[4]]


@pytest.mark.parametrize("fn, message", [
    (lambda h, row: 1 / 0, "raised ZeroDivisionError: division by zero"),
    (lambda h, row: row.tolist(), "returned a list, not a torch.Tensor"),
    (lambda h, row: row[:-1], f"returned a tensor of shape ({VOCAB - 1},), not ({VOCAB},)"),
    (lambda h, row: row.long(), "returned a torch.int64 tensor, not floating point"),
    (lambda h, row: row.fill_(float("-inf")), "no finite logit"),
    (lambda h, row: row.index_fill_(0, torch.tensor([3]), float("nan")), "NaN"),
    (lambda h, row: row.index_fill_(0, torch.tensor([3]), float("inf")), "+inf"),
])
def test_a_failing_processor_fails_its_request_only(fn, message):
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.normal(size=(3, VOCAB)).astype(np.float32))
    before = logits.clone()
    calls = []

    def after(history, row):                       # never reached after a failure
        calls.append(1)
        return row

    extras = {1: _extras(fn, after), 2: _extras(lambda h, row: row - 1.0)}
    failures = apply_logits_processors(logits, _batch([1, 2, 3]), extras)
    assert list(failures) == [1] and message in failures[1], failures
    if "raised" in message or "returned" in message:
        assert "<lambda>" in failures[1] and calls == []
    assert torch.equal(logits[0], torch.zeros(VOCAB))          # nothing left to sample from
    torch.testing.assert_close(logits[1], before[1] - 1.0)
    torch.testing.assert_close(logits[2], before[2])


def test_arity_and_parameter_checks():
    assert processor_arity(lambda h, row: row) == 2
    assert processor_arity(lambda p, h, row: row) == 3
    assert processor_arity(lambda p, h, row, scale=2.0: row) == 3      # defaults do not count

    class Ban:
        def __call__(self, history, row):
            return row

    assert processor_arity(Ban()) == 2
    for bad, match in [(lambda row: row, "takes 1 positional"),
                       (lambda a, b, c, d: d, "takes 4 positional"),
                       ("not callable", "must be callables")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(logits_processors=[bad])
    with pytest.raises(ValueError, match="list of callables"):
        SamplingParams(logits_processors={"a": 1})
    one = Ban()
    p = SamplingParams(logits_processors=one)                     # a single callable
    assert p.logits_processors == (one,)
    assert not p.allows_speculation and p.needs_token_history
    assert SamplingParams(logits_processors=None).logits_processors == ()
    assert SamplingParams().allows_speculation


def test_import_paths_resolve_when_configured(tmp_path, monkeypatch):
    (tmp_path / "my_processors.py").write_text(
        "class Ban:\n"
        "    def new_req_logits_processor(self, params):\n"
        "        return None\n"
        "def factory(params):\n"
        "    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    EngineConfig(logits_processors=["my_processors:Ban", "my_processors.factory"])
    for entry, message in [("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
                           ("my_processors:missing", "has no 'missing'"),
                           ("plainword", "not an import path"),
                           (3, "import paths")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(logits_processors=[entry])


# -- on the real engine --------------------------------------------------------------------

def _keep_only(token_ids):
    keep = torch.tensor(sorted(token_ids))

    def keep_only(history, row):
        out = torch.full_like(row, float("-inf"))
        out[keep] = row[keep]
        return out
    return keep_only


def test_a_masking_processor_equals_allowed_token_ids(real_llm):
    """A processor keeping four tokens gives what `allowed_token_ids` with those four gives,
    greedy and seeded-sampled alike, and the sampler's logprobs are the processed row's."""
    prompt = "My favourite fruit is"
    base = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    top = real_llm.generate(prompt, base)[0].outputs[0].logprobs[0].top
    allowed = [t for t, _ in top[1:5]]
    for params in (base, base.replace(temperature=1.3, seed=11)):
        by_param = real_llm.generate(prompt, params.replace(allowed_token_ids=allowed))[0]
        by_fn = real_llm.generate(prompt, params.replace(
            logits_processors=[_keep_only(allowed)]))[0]
        assert by_fn.outputs[0].token_ids == by_param.outputs[0].token_ids
        assert set(by_fn.outputs[0].token_ids) <= set(allowed)
        # the processed row: only the four allowed tokens have a probability
        top_fn = by_fn.outputs[0].logprobs[0].top
        assert {t for t, lp in top_fn if lp > float("-inf")} == set(allowed)
    assert real_llm.engine.check_accounting()["tracked_extras"] == 0


def test_a_biasing_processor_equals_logit_bias(real_llm):
    prompt = "The weather today is"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = real_llm.generate(prompt, params)[0].outputs[0].token_ids
    bias = {plain[1]: -100.0, plain[2]: 5.0}

    def add_bias(history, row):
        for t, b in bias.items():
            row[t] += b
        return row

    by_param = real_llm.generate(prompt, params.replace(logit_bias=bias))[0].outputs[0]
    by_fn = real_llm.generate(prompt, params.replace(logits_processors=[add_bias]))[0].outputs[0]
    assert by_fn.token_ids == by_param.token_ids != plain


def test_processors_see_each_sequences_own_history_and_the_prompt(real_llm):
    """n = 2 sampled sequences: each call gets the tokens its own sequence generated before it,
    and the prompt's ids in the three-argument form."""
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def record(prompt_ids, history, row):
        calls.append((tuple(prompt_ids), tuple(history)))
        return row

    params = SamplingParams(n=2, max_tokens=7, temperature=1.0, seed=5, ignore_eos=True,
                            logits_processors=[record])
    out = real_llm.generate("Once upon a time", params)[0]
    assert {c[0] for c in calls} == {tuple(out.prompt_token_ids)}
    expected = sorted(tuple(s.token_ids[:k]) for s in out.outputs for k in range(7))
    assert sorted(c[1] for c in calls) == expected


def test_a_raising_processor_fails_its_request_and_the_engine_goes_on(real_llm):
    """A processor that raises on its third call ends that request with "error" and a message
    naming it; the requests beside it in the same steps give their solo outputs."""
    calls = []

    def flaky(history, row):
        calls.append(len(history))
        if len(history) == 2:
            raise RuntimeError("bad state")
        return row

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Water boils at"]
    solo = [real_llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    outs = real_llm.generate(prompts, [params, params.replace(logits_processors=[flaky]), params])
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error"
    assert "flaky" in outs[1].error and "RuntimeError: bad state" in outs[1].error
    assert calls == [0, 1, 2] and len(failed.token_ids) == 2
    assert [outs[i].outputs[0].token_ids for i in (0, 2)] == [solo[0], solo[2]]
    again = real_llm.generate(prompts[1], params)[0].outputs[0]
    assert again.finish_reason == "length" and again.token_ids == solo[1]
    assert real_llm.engine.check_accounting()["tracked_extras"] == 0


def test_failing_and_cancelled_processor_requests_leave_nothing_behind(real_llm):
    """24 concurrent requests: a third with a processor that raises at some token, a third
    cancelled part-way (with a processor), the rest plain. The failed ones end with "error",
    the plain ones give their solo outputs, and the engine ends idle with nothing tracked."""
    import asyncio
    import random

    engine = real_llm.engine
    rng = random.Random(3)
    prompts = [f"Story {i}: once upon a time" for i in range(24)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    solo = {i: real_llm.generate(prompts[i], params)[0].outputs[0].token_ids
            for i in range(0, 24, 3)}

    def raising_at(k):
        def fn(history, row):
            if len(history) == k:
                raise ValueError(f"bad at {k}")
            return row
        return fn

    async def one(i):
        kind = i % 3                     # 0 plain, 1 a processor that raises, 2 cancelled
        p = params.replace(output_kind="delta")
        if kind:
            p = p.replace(logits_processors=[raising_at(rng.randrange(1, 10)) if kind == 1
                                             else (lambda h, row: row)])
        tokens, last = [], None
        async for out in engine.generate(prompts[i], p, request_id=f"storm-{i}"):
            tokens.extend(out.outputs[0].token_ids)
            last = out
            if kind == 2 and len(tokens) >= 4:
                engine.abort(f"storm-{i}")
        return kind, last, tokens

    async def storm():
        return await asyncio.gather(*(one(i) for i in range(24)))

    results = real_llm._run(storm())
    for i, (kind, last, tokens) in enumerate(results):
        reason = last.outputs[0].finish_reason
        if kind == 0:
            assert tokens == solo[i] and reason == "length"
        elif kind == 1:
            assert reason == "error" and "bad at" in last.error
        else:
            assert reason == "abort"
    real_llm._run(engine.check_idle_clean())
    assert engine.check_accounting()["tracked_extras"] == 0
