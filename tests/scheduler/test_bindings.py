"""Tests of the ferrobatch._scheduler bindings on hand-built scenarios.

A tiny fake runner keeps a simulated KV cache (token per slot) and samples from the context it
reads back through `block_tables`, so wrong slot mappings, block tables, prefix hits or
copy-on-write would change the outputs compared to a direct reference generation.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ferrobatch._scheduler import Intake, QueueFullError, Scheduler, StepBatch, StepOutput

VOCAB = 50
EOS = 0


def model(ctx: list[int], k: int) -> int:
    h = 1469598103934665603 ^ (k * 0x9E3779B9)
    for t in ctx:
        h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 29
    return int(h % VOCAB)


def reference(prompt, k, max_tokens):
    """ignore_eos generation of sequence k (what the scheduler must reproduce)."""
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(model(ctx, k))
    return ctx[len(prompt):]


class FakeRunner:
    def __init__(self, sched: Scheduler):
        self.bs = sched.block_size
        self.kv = np.full((sched.num_blocks * self.bs, 2), -1, dtype=np.int64)

    def execute(self, b: StepBatch) -> np.ndarray:
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices"):
            arr = getattr(b, name)
            assert arr.dtype == np.int32 and arr.flags.c_contiguous, name
        assert b.seq_req_ids.dtype == np.uint64 and b.suppress_eos.dtype == np.uint8
        assert b.seed.dtype == np.int64 and b.temperature.dtype == np.float32
        assert b.block_tables.shape == (b.num_seqs, b.block_tables.shape[1]) and b.block_tables.dtype == np.int32
        assert b.block_copies.shape == (len(b.block_copies), 2)
        assert len(b.input_ids) == b.num_tokens == b.num_prefill_tokens + b.num_decode_tokens
        assert len(b.logits_indices) == b.num_samples
        bs = self.bs
        if len(b.block_copies):
            src, dst = b.block_copies[:, 0], b.block_copies[:, 1]
            view = self.kv.reshape(-1, bs, 2)
            view[dst] = view[src]
        self.kv[b.slot_mapping, 0] = b.input_ids
        self.kv[b.slot_mapping, 1] = b.positions
        out = np.empty(b.num_samples, dtype=np.int32)
        ends = b.query_start_loc[1:] - 1
        for r, li in enumerate(b.logits_indices):
            i = int(np.nonzero(ends == li)[0][0])
            n = int(b.seq_lens[i])
            pos = np.arange(n)
            slots = b.block_tables[i][pos // bs] * bs + pos % bs
            assert (self.kv[slots, 1] == pos).all()
            t = model([int(x) for x in self.kv[slots, 0]], int(b.sample_seq_indices[r]))
            while b.suppress_eos[r] and t == EOS:
                t = (t + 1) % VOCAB
            out[r] = t
        return out


def make(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 64)
    return Scheduler(num_blocks, block_size, vocab_size=VOCAB, eos_token_ids=[EOS], **kw)


def step(s, r):
    b = s.schedule()
    s.check_integrity()
    o = s.update(r.execute(b))
    s.check_integrity()
    events = list(zip(o.req_ids.tolist(), o.seq_indices.tolist(), o.token_ids.tolist(), o.finish_reasons.tolist()))
    return b, o, events


def run_all(s, r, limit=500):
    events, errors = [], {}
    for _ in range(limit):
        if not s.has_unfinished():
            break
        _, o, ev = step(s, r)
        events += ev
        errors.update(o.error_messages)
    assert not s.has_unfinished()
    st = s.stats()
    assert st["num_used_blocks"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0
    return events, errors


def tokens_of(events, rid, k=0):
    return [t for (i, kk, t, _) in events if i == rid and kk == k and t >= 0]


def reasons_of(events, rid, k=0):
    return [f for (i, kk, _, f) in events if i == rid and kk == k and f != 0]


def test_module_surface():
    s = make()
    assert isinstance(s.intake(), Intake)
    assert issubclass(QueueFullError, RuntimeError) and QueueFullError is not RuntimeError
    b = s.schedule()
    assert b.num_tokens == 0 and b.block_tables.shape[0] == 0 and b.block_copies.shape == (0, 2)
    o = s.update(np.empty(0, dtype=np.int32))
    assert isinstance(o, StepOutput) and len(o) == 0 and o.error_messages == {}
    st = s.stats()
    for key in ("num_waiting", "num_running", "num_free_blocks", "num_cached_blocks", "num_used_blocks", "num_blocks",
                "kv_cache_usage", "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                "num_prompt_tokens_total", "num_generation_tokens_total", "intake_queue_len"):
        assert key in st
    assert st["num_free_blocks"] + st["num_cached_blocks"] + st["num_used_blocks"] == s.num_blocks - 1


def test_chunked_prefill_over_several_steps_then_decode():
    s = make(max_num_batched_tokens=4)
    r = FakeRunner(s)
    s.intake().submit(1, np.arange(1, 11, dtype=np.int64), max_tokens=3, ignore_eos=True)
    sizes = []
    for _ in range(3):
        b, _, ev = step(s, r)
        sizes.append((b.num_tokens, b.num_samples, len(ev)))
    assert sizes == [(4, 0, 0), (4, 0, 0), (2, 1, 1)]
    b, _, ev = step(s, r)
    assert (b.num_decode_tokens, b.positions.tolist(), b.sample_output_lens.tolist()) == (1, [10], [1])
    events, _ = run_all(s, r)
    assert len(tokens_of(events, 1)) == 1 and reasons_of(events, 1) == [2]


def test_decode_matches_reference_and_eos_rules():
    s = make()
    r = FakeRunner(s)
    i = s.intake()
    i.submit(1, [5, 6, 7], max_tokens=6, ignore_eos=True, temperature=0.0, seed=3)
    b = s.schedule()
    assert b.temperature.tolist() == [0.0] and b.seed.tolist() == [3] and b.top_k.tolist() == [0]
    o = s.update(r.execute(b))
    events, _ = run_all(s, r)
    assert [o.token_ids[0]] + tokens_of(events, 1) == reference([5, 6, 7], 0, 6)
    # min_tokens: EOS masked (suppress_eos) and not finishing before min_tokens.
    i.submit(2, [1, 2], max_tokens=5, min_tokens=2)
    b = s.schedule()
    assert b.suppress_eos.tolist() == [1]
    assert s.update(np.array([EOS], np.int32)).finish_reasons.tolist() == [0]
    s.schedule()
    s.update(np.array([4], np.int32))
    b = s.schedule()
    assert b.suppress_eos.tolist() == [0]
    assert s.update(np.array([EOS], np.int32)).finish_reasons.tolist() == [1]


def test_preemption_and_recompute_keep_outputs():
    s = make(num_blocks=7, block_size=2)  # 6 usable blocks: two growing requests cannot both fit
    r = FakeRunner(s)
    prompts = {1: [2, 7, 9, 11], 2: [3, 7, 9, 11]}
    for rid, p in prompts.items():
        s.intake().submit(rid, p, max_tokens=6, ignore_eos=True)
    events, _ = run_all(s, r)
    assert s.stats()["num_preemptions_total"] >= 1
    for rid, p in prompts.items():
        assert tokens_of(events, rid) == reference(p, 0, 6)
        assert reasons_of(events, rid) == [2]


def test_preemption_cap_reports_error():
    s = make(num_blocks=7, block_size=2, max_preemptions=0)
    r = FakeRunner(s)
    for rid in (1, 2):
        s.intake().submit(rid, [5, 7, 9, 11], max_tokens=6, ignore_eos=True)
    events, errors = run_all(s, r)
    assert reasons_of(events, 2) == [4] and reasons_of(events, 1) == [2]
    assert "preempted" in errors[2]


def test_abort_mid_prefill_and_mid_decode():
    s = make(max_num_batched_tokens=4)
    r = FakeRunner(s)
    i = s.intake()
    i.submit(1, list(range(1, 11)), max_tokens=5)
    i.submit(2, [3, 4], max_tokens=50, ignore_eos=True)
    step(s, r)  # request 1: first chunk
    i.abort(1)
    i.abort(1)  # idempotent
    i.abort(12345)  # unknown: ignored
    _, _, ev = step(s, r)
    assert (1, 0, -1, 3) in ev and sum(e[0] == 1 for e in ev) == 1
    for _ in range(3):
        step(s, r)  # request 2 decoding
    i.abort(2, reason="stop")  # the engine matched a stop string
    _, _, ev = step(s, r)
    assert ev == [(2, 0, -1, 1)]
    assert not s.has_unfinished() and s.stats()["num_used_blocks"] == 0


def test_prefix_hit_reuses_blocks_and_changes_nothing():
    s = make()
    r = FakeRunner(s)
    prompt = list(range(1, 10))
    s.intake().submit(1, prompt, max_tokens=4, ignore_eos=True)
    ev1, _ = run_all(s, r)
    assert s.stats()["num_cached_blocks"] >= 2
    s.intake().submit(2, prompt, max_tokens=4, ignore_eos=True)
    b, _, first = step(s, r)
    assert b.num_tokens == 1 and b.positions.tolist() == [8]
    st = s.stats()
    assert st["prefix_cache_hits_total"] == 8 and st["prefix_cache_queries_total"] == 18
    ev2, _ = run_all(s, r)
    assert tokens_of(ev1, 1) == tokens_of(first + ev2, 2)
    s.intake().submit(3, prompt, max_tokens=1, cache_salt="other-tenant")
    assert s.schedule().num_tokens == 9
    s.update(np.array([1], np.int32))


def test_parallel_sampling_shares_prompt_and_copies_on_write():
    s = make()
    r = FakeRunner(s)
    s.intake().submit(7, [1, 2, 3, 4, 5, 6], max_tokens=4, n=3, ignore_eos=True)
    b, _, ev = step(s, r)
    assert b.num_tokens == 6
    assert b.logits_indices.tolist() == [5, 5, 5] and b.sample_seq_indices.tolist() == [0, 1, 2]
    assert sorted(e[1] for e in ev) == [0, 1, 2]
    assert s.stats()["num_used_blocks"] == 2
    b, _, ev2 = step(s, r)
    assert b.block_copies.shape == (2, 2)
    events, _ = run_all(s, r)
    events = ev2 + events
    for k in range(3):
        assert tokens_of(ev + events, 7, k) == reference([1, 2, 3, 4, 5, 6], k, 4)
        assert reasons_of(events, 7, k) == [2]


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((1, []), {"max_tokens": 4}, "empty"),
        ((1, [1, VOCAB]), {"max_tokens": 4}, "outside"),
        ((1, [-1]), {"max_tokens": 4}, "outside"),
        ((1, np.array([1, 2**40])), {"max_tokens": 4}, "outside"),
        ((1, "abc"), {"max_tokens": 4}, "str"),
        ((1, [1]), {"max_tokens": 0}, "max_tokens"),
        ((1, [1]), {"max_tokens": 64}, "max_model_len"),
        ((1, [1]), {"max_tokens": 4, "n": 0}, "n must"),
        ((1, [1]), {"max_tokens": 4, "n": 10**6}, "n must"),
        ((1, [1]), {"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ((1, [1]), {"max_tokens": 4, "temperature": float("nan")}, "temperature"),
        ((1, [1]), {"max_tokens": 4, "stop_token_ids": [999]}, "stop_token_ids"),
        ((1, [1]), {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ((1, [1]), {"max_tokens": 4, "seed": -5}, "seed"),
        ((-1, [1]), {"max_tokens": 4}, "request_id"),
        ((2**64, [1]), {"max_tokens": 4}, "request_id"),
    ],
)
def test_bad_input_raises_value_error(args, kwargs, match):
    s = make()
    with pytest.raises(ValueError, match=match):
        s.intake().submit(*args, **kwargs)
    assert s.stats()["intake_queue_len"] == 0


def test_never_fits_duplicate_and_protocol_errors():
    s = Scheduler(5, 4, vocab_size=VOCAB, max_model_len=64)  # 4 usable blocks = 16 tokens
    i = s.intake()
    with pytest.raises(ValueError, match="blocks"):
        i.submit(1, [1] * 16, max_tokens=2)
    i.submit(1, [1] * 15, max_tokens=2)
    with pytest.raises(ValueError, match="already in use"):
        i.submit(1, [1], max_tokens=1)
    with pytest.raises(ValueError, match="reason"):
        i.abort(1, reason="nope")
    with pytest.raises(ValueError):
        s.update(np.empty(0, np.int32))  # no schedule() yet
    b = s.schedule()
    with pytest.raises(ValueError):
        s.schedule()  # update() pending
    with pytest.raises(ValueError, match="num_samples"):
        s.update(np.zeros(b.num_samples + 1, np.int32))
    with pytest.raises(ValueError, match="outside"):
        s.update(np.full(b.num_samples, VOCAB, np.int32))
    s.update(np.zeros(b.num_samples, np.int64))  # int64 accepted too
    s.check_integrity()
    for bad in (dict(num_blocks=1), dict(num_blocks=-3), dict(num_blocks=1 << 30), dict(policy="lifo"), dict(block_size=0)):
        kw = dict(num_blocks=8, vocab_size=VOCAB) | bad
        with pytest.raises(ValueError):
            Scheduler(**kw)


def test_queue_full_and_wait_for_work_across_threads():
    s = make(intake_capacity=2)
    i = s.intake()
    i.submit(1, [1], max_tokens=1)
    i.submit(2, [1], max_tokens=1)
    with pytest.raises(QueueFullError):
        i.submit(3, [1], max_tokens=1)
    assert i.wait_for_work(0.0) is True
    s.schedule()
    s.update(np.array([4, 4], np.int32))
    s.schedule()
    s.update(np.empty(0, np.int32))
    assert not s.has_unfinished()
    assert i.wait_for_work(0.01) is False
    t = threading.Timer(0.05, lambda: i.submit(3, [1], max_tokens=1))
    t.start()
    t0 = time.monotonic()
    assert i.wait_for_work(10.0) is True
    assert time.monotonic() - t0 < 5
    t.join()
    threading.Timer(0.05, i.notify).start()
    s.schedule()
    s.update(np.array([4], np.int32))
    assert i.wait_for_work(10.0) is False  # woken by notify(), nothing queued


def test_priority_policy():
    s = make(policy="priority", max_num_seqs=1)
    for rid, prio in ((1, 5), (2, -1), (3, 0)):
        s.intake().submit(rid, [1], max_tokens=1, priority=prio)
    order = []
    for _ in range(3):
        s.schedule()
        order.append(int(s.update(np.array([4], np.int32)).req_ids[0]))
    assert order == [2, 3, 1]


def test_speculative_step_arrays_and_acceptance():
    """A drafted decode, by hand: prompt lookup drafts what followed the last earlier
    occurrence of the final n-gram; update() keeps the agreeing prefix plus one token and
    frees the blocks only the rejected drafts used."""
    s = make(num_blocks=16, block_size=4, num_speculative_tokens=3, speculative_ngram_min=2,
             speculative_ngram_max=2)
    i = s.intake()
    prompt = [7, 8, 9, 10, 11, 12, 7]
    i.submit(1, prompt, max_tokens=20, ignore_eos=True, temperature=0.0, speculate=True)
    i.submit(2, prompt, max_tokens=20, ignore_eos=True, temperature=0.0)   # never drafts
    b = s.schedule()
    assert b.num_draft_tokens == 0 and b.num_samples == 2          # prefills sample once each
    s.update(np.array([8, 8], np.int32))                           # both now end "... 7 8"
    b = s.schedule()
    # request 1: its last token 8 plus drafts 9 10 11 (what followed "7 8" in the prompt)
    assert b.num_draft_tokens == 3 and b.num_decode_tokens == 2 and b.num_tokens == 5
    assert b.input_ids.tolist() == [8, 9, 10, 11, 8]
    assert b.positions.tolist() == [7, 8, 9, 10, 7]
    assert b.query_start_loc.tolist() == [0, 4, 5] and b.seq_lens.tolist() == [11, 8]
    assert b.logits_indices.tolist() == [0, 1, 2, 3, 4]
    assert b.sample_output_lens.tolist() == [1, 2, 3, 4, 1]
    assert b.sample_req_ids.tolist() == [1, 1, 1, 1, 2]
    assert b.block_tables[0, 2] != 0                               # room for the drafts
    s.check_integrity()
    # the model agrees with 9 and 10, then says 5 instead of 11: 9 10 5 are appended
    o = s.update(np.array([9, 10, 5, 6, 3], np.int32))
    assert list(zip(o.req_ids.tolist(), o.token_ids.tolist())) == \
        [(1, 9), (1, 10), (1, 5), (2, 3)]
    s.check_integrity()              # request 1: 10 tokens computed, in 3 blocks
    st = s.stats()
    assert (st["num_draft_tokens_total"], st["num_accepted_tokens_total"]) == (3, 2)
    assert st["num_generation_tokens_total"] == 2 + 4
    b = s.schedule()                 # "... 10 5": the bigram "10 5" never occurred: no draft
    assert b.num_draft_tokens == 0 and b.input_ids.tolist() == [5, 3]
    s.update(np.array([1, 1], np.int32))
    i.abort(1)
    i.abort(2)
    run_all(s, FakeRunner(s))
    # a first draft refused: the block that only the drafts used goes back to the pool
    i.submit(3, prompt, max_tokens=20, ignore_eos=True, temperature=0.0, speculate=True)
    s.schedule()
    s.update(np.array([8], np.int32))
    b = s.schedule()
    assert b.num_draft_tokens == 3 and b.seq_lens.tolist() == [11]
    used = s.stats()["num_used_blocks"]
    o = s.update(np.array([5, 10, 11, 12], np.int32))
    assert o.token_ids.tolist() == [5]
    assert s.stats()["num_used_blocks"] == used - 1       # 9 tokens, 8 computed: 2 blocks
    s.check_integrity()
    i.abort(3)
    run_all(s, FakeRunner(s))


def test_speculation_config_is_validated():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make(num_speculative_tokens=17)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make(num_speculative_tokens=8, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="n-gram"):
        make(speculative_ngram_min=3, speculative_ngram_max=2)
    with pytest.raises(ValueError, match="n-gram"):
        make(speculative_ngram_min=0)


def test_refused_drafts_back_off():
    """After the model refuses a draft outright the sequence skips drafting for a step, even
    where an n-gram matches, then drafts again."""
    s = make(num_blocks=16, block_size=4, num_speculative_tokens=3, speculative_ngram_min=1,
             speculative_ngram_max=2)
    s.intake().submit(1, [7, 8, 9, 10, 11, 12, 7], max_tokens=20, ignore_eos=True,
                      temperature=0.0, speculate=True)
    s.schedule()
    s.update(np.array([8], np.int32))
    b = s.schedule()
    assert b.input_ids.tolist() == [8, 9, 10, 11]                 # "7 8" -> 9 10 11
    s.update(np.array([11, 1, 1, 1], np.int32))                    # 9 refused: "... 8 11"
    b = s.schedule()
    assert b.num_draft_tokens == 0 and b.input_ids.tolist() == [11]   # "11" recurs, but waits
    s.update(np.array([12], np.int32))
    b = s.schedule()
    assert b.input_ids.tolist() == [12, 7, 8, 11]                  # "11 12" -> 7 8 11
    s.update(np.array([7, 8, 11, 2], np.int32))                    # all three accepted
    st = s.stats()
    assert (st["num_draft_tokens_total"], st["num_accepted_tokens_total"]) == (6, 3)
    s.check_integrity()
    s.intake().abort(1)
    run_all(s, FakeRunner(s))


def _two_speculating(**cfg):
    """Two speculating requests with the same prompt, prefilled, both ending "... 7 8" (prompt
    lookup then drafts 9 10 11 for each)."""
    s = make(block_size=4, num_speculative_tokens=3, speculative_ngram_min=2,
             speculative_ngram_max=2, **cfg)
    for rid in (1, 2):
        s.intake().submit(rid, [7, 8, 9, 10, 11, 12, 7], max_tokens=20, ignore_eos=True,
                          temperature=0.0, speculate=True)
    s.schedule()
    s.update(np.array([8, 8], np.int32))
    return s


def test_drafts_share_the_step_token_cap_evenly():
    """With speculative_max_step_tokens the step's rows left after the decodes are shared
    among the drafting sequences (one each of 2 rows; 2 and 1 of 3 rows), not all given to
    the first."""
    for cap, drafts in ((4, [1, 1]), (5, [2, 1]), (0, [3, 3]), (2, [0, 0])):
        s = _two_speculating(num_blocks=16, speculative_max_step_tokens=cap)
        b = s.schedule()
        ids = b.sample_req_ids.tolist()
        assert [ids.count(1) - 1, ids.count(2) - 1] == drafts, cap
        assert b.num_draft_tokens == sum(drafts)
        assert cap == 0 or b.num_tokens <= cap
        s.check_integrity()
        s.update(np.array([9, 10, 11, 12][:drafts[0] + 1] + [9, 10, 11, 12][:drafts[1] + 1],
                          np.int32))
        s.check_integrity()
        assert s.stats()["num_accepted_tokens_total"] == sum(drafts)


def test_adaptive_draft_length_follows_acceptance():
    """With speculative_adaptive, drafts the model cut short at A accepted tokens are followed
    by at most A + 1 drafts, and drafts accepted in full by K again; without it, always K."""
    for adaptive, expected in ((True, [3, 2, 3]), (False, [3, 3, 3])):
        s = make(num_speculative_tokens=3, speculative_ngram_min=1, speculative_ngram_max=2,
                 speculative_adaptive=adaptive)
        s.intake().submit(1, list(range(1, 9)) * 3, max_tokens=30, ignore_eos=True,
                          temperature=0.0, speculate=True)
        s.schedule()
        s.update(np.array([1], np.int32))                # context ends "8 1"
        drafted = []
        # drafts "2 3 4": the model agrees on 2 only, then says 5 (accepted 1);
        # then drafts for "5" are "6 7 8" (2 of them when adaptive): all accepted
        for answer in ([2, 5, 0, 0], [6, 7, 8, 1]):
            b = s.schedule()
            s.check_integrity()
            drafted.append(b.num_draft_tokens)
            s.update(np.array(answer[:b.num_draft_tokens + 1], np.int32))
            s.check_integrity()
        drafted.append(s.schedule().num_draft_tokens)
        assert drafted == expected, adaptive


def test_drafts_never_take_what_another_sequence_needs():
    """Drafts are scheduled last: they never take the block a later running sequence needs
    (which would preempt it) nor the step budget a waiting prompt could use."""
    # 5 usable blocks: each sequence holds 2 (7 and 8 computed tokens of block size 4); the
    # one free block is the second sequence's next one, so the first one drafts nothing.
    s = make(num_blocks=6, block_size=4, num_speculative_tokens=3, speculative_ngram_min=2,
             speculative_ngram_max=2)
    s.intake().submit(1, [7, 8, 9, 10, 11, 12, 7], max_tokens=8, ignore_eos=True,
                      temperature=0.0, speculate=True)
    s.intake().submit(2, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=8, ignore_eos=True,
                      temperature=0.0)
    s.schedule()
    s.update(np.array([8, 3], np.int32))
    b = s.schedule()
    assert b.num_draft_tokens == 0 and b.seq_req_ids.tolist() == [1, 2]
    assert s.stats()["num_preemptions_total"] == 0
    s.check_integrity()
    s.update(np.array([9, 4], np.int32))
    # budget 6: a running decode (1) and a new 4-token prompt (4) leave 1 row for a draft
    s = make(num_blocks=32, block_size=4, max_num_batched_tokens=6, num_speculative_tokens=3,
             speculative_ngram_min=2, speculative_ngram_max=2)
    s.intake().submit(1, [7, 8, 9, 10, 11, 12, 7], max_tokens=20, ignore_eos=True,
                      temperature=0.0, speculate=True)
    s.schedule()                                       # 6 of 7 prompt tokens
    s.update(np.array([], np.int32))
    s.schedule()
    s.update(np.array([8], np.int32))
    s.intake().submit(2, [1, 2, 3, 4], max_tokens=5)
    b = s.schedule()
    assert b.input_ids.tolist() == [8, 9, 1, 2, 3, 4]
    assert (b.num_draft_tokens, b.num_prefill_tokens) == (1, 4)
    s.check_integrity()


def test_admission_batch_refills_in_groups_and_keeps_outputs():
    """``admission_batch=3``: once the first four run, waiting requests join three at a time
    (or the last ones left), never one by one; the outputs are the reference's and the pool
    ends empty. Validated at construction."""
    def run(**kw):
        s = make(num_blocks=128, max_num_seqs=4, **kw)
        r = FakeRunner(s)
        i = s.intake()
        lens = [3, 9, 5, 14, 4, 7, 6, 11, 2, 8, 5, 3]
        for rid, n in enumerate(lens, 1):
            i.submit(rid, [rid % 7 + 1, 2, 3], max_tokens=n, ignore_eos=True)
        seen, joins, events = set(), [], []
        for _ in range(500):
            if not s.has_unfinished():
                break
            b, _, ev = step(s, r)
            new = {int(x) for x in b.seq_req_ids} - seen
            seen |= new
            if new:
                joins.append(len(new))
            events += ev
        rest, _ = run_all(s, r)
        for rid, n in enumerate(lens, 1):
            assert tokens_of(events + rest, rid) == reference([rid % 7 + 1, 2, 3], 0, n)
        holds = s.stats()["num_admission_holds_total"]
        assert (holds > 0) == (kw.get("admission_batch", 1) > 1
                               and kw.get("admission_max_wait_steps", 8) > 0), holds
        return joins

    plain = run()
    assert plain[0] == 4 and 1 in plain[1:]
    grouped = run(admission_batch=3, admission_max_wait_steps=100)
    assert grouped[0] == 4 and all(n >= 3 for n in grouped[1:-1]), grouped
    assert run(admission_batch=3, admission_max_wait_steps=0) == plain
    for bad in (dict(admission_batch=0), dict(admission_batch=5), dict(admission_batch=-1),
                dict(admission_max_wait_steps=-2)):
        with pytest.raises(ValueError, match="admission"):
            make(max_num_seqs=4, **bad)
