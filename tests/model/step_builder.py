"""A toy paged scheduler for tests: emits the README's step arrays (duck-typed StepBatch).

It hands out blocks in shuffled order, chunks prefills under a token budget, shares full prompt
blocks between sequences with equal prefixes (prefix reuse), and mixes decode and prefill rows.
Per-token Python loops are fine here: this is a test helper, not the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np


@dataclass
class ToySequence:
    req_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in shared blocks

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


@dataclass
class StepBatch:
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    block_copies: np.ndarray
    seq_req_ids: np.ndarray
    seq_indices: np.ndarray
    logits_indices: np.ndarray
    sample_req_ids: np.ndarray
    sample_seq_indices: np.ndarray
    sample_output_lens: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    seed: np.ndarray
    suppress_eos: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.logits_indices.shape[0])


def sampling_arrays(num_samples: int, **overrides) -> dict[str, np.ndarray]:
    """Default (greedy, everything off) per-sample arrays, with optional overrides."""
    arrays = {
        "sample_output_lens": np.zeros(num_samples, np.int32),
        "temperature": np.zeros(num_samples, np.float32),
        "top_k": np.zeros(num_samples, np.int32),
        "top_p": np.ones(num_samples, np.float32),
        "min_p": np.zeros(num_samples, np.float32),
        "repetition_penalty": np.ones(num_samples, np.float32),
        "presence_penalty": np.zeros(num_samples, np.float32),
        "frequency_penalty": np.zeros(num_samples, np.float32),
        "seed": np.full(num_samples, -1, np.int64),
        "suppress_eos": np.zeros(num_samples, np.uint8),
        "sample_req_ids": np.arange(num_samples, dtype=np.uint64),
        "sample_seq_indices": np.zeros(num_samples, np.int32),
    }
    for name, value in overrides.items():
        arrays[name] = np.asarray(value, dtype=arrays[name].dtype)
    return arrays


class ToyScheduler:
    """Greedy toy scheduler over a shuffled free list of KV blocks (block 0 = null)."""

    def __init__(self, num_blocks: int, block_size: int, token_budget: int = 64, seed: int = 0):
        self.block_size = block_size
        self.token_budget = token_budget
        rng = np.random.default_rng(seed)
        self.free_blocks = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
        self.sequences: list[ToySequence] = []
        self.prefix_blocks: dict[tuple[int, ...], int] = {}  # full-block token prefix -> block id

    def add(self, req_id: int, prompt: list[int], max_new_tokens: int) -> ToySequence:
        seq = ToySequence(req_id, list(prompt), len(prompt), max_new_tokens)
        # Prefix reuse: share full prompt blocks already computed by another sequence; always
        # leave at least one prompt token to compute so the step produces logits.
        bs = self.block_size
        for i in range((len(prompt) - 1) // bs):
            block = self.prefix_blocks.get(tuple(prompt[: (i + 1) * bs]))
            if block is None:
                break
            seq.block_ids.append(block)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_ids) * bs
        self.sequences.append(seq)
        return seq

    def _ensure_blocks(self, seq: ToySequence, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            seq.block_ids.append(self.free_blocks.pop())

    def schedule(self) -> StepBatch | None:
        budget = self.token_budget
        rows = []  # (seq, start, count)
        for seq in self.sequences:
            if seq.finished or budget == 0:
                continue
            count = min(len(seq.tokens) - seq.num_computed_tokens, budget)
            self._ensure_blocks(seq, seq.num_computed_tokens + count)
            rows.append((seq, seq.num_computed_tokens, count))
            budget -= count
        if not rows:
            return None
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens, logits_idx, sample_seqs = [], [], [], [0], [], [], []
        for seq, start, count in rows:
            for p in range(start, start + count):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.block_ids[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + count)
            seq_lens.append(start + count)
            if start + count == len(seq.tokens):
                logits_idx.append(qsl[-1] - 1)
                sample_seqs.append(seq)
        max_blocks = max(len(s.block_ids) for s, _, _ in rows)
        tables = np.zeros((len(rows), max_blocks), np.int32)
        for i, (seq, _, _) in enumerate(rows):
            tables[i, : len(seq.block_ids)] = seq.block_ids
        self._scheduled = rows
        self._sampled_seqs = sample_seqs
        arrays = sampling_arrays(
            len(sample_seqs),
            sample_req_ids=[s.req_id for s in sample_seqs],
            sample_output_lens=[len(s.output_ids) for s in sample_seqs])
        return StepBatch(
            input_ids=np.asarray(ids, np.int32), positions=np.asarray(pos, np.int32),
            slot_mapping=np.asarray(slots, np.int32), query_start_loc=np.asarray(qsl, np.int32),
            seq_lens=np.asarray(seq_lens, np.int32), block_tables=tables,
            block_copies=np.zeros((0, 2), np.int32),
            seq_req_ids=np.asarray([s.req_id for s, _, _ in rows], np.uint64),
            seq_indices=np.zeros(len(rows), np.int32),
            logits_indices=np.asarray(logits_idx, np.int32), **arrays)

    def update(self, sampled: np.ndarray) -> None:
        bs = self.block_size
        for seq, start, count in self._scheduled:
            seq.num_computed_tokens = start + count
            for i in range(start // bs, (start + count) // bs):  # newly full blocks become shareable
                if (i + 1) * bs <= seq.prompt_len:
                    self.prefix_blocks.setdefault(tuple(seq.tokens[: (i + 1) * bs]), seq.block_ids[i])
        for seq, token in zip(self._sampled_seqs, sampled, strict=True):
            seq.tokens.append(int(token))


def run_to_completion(runner, sampler, scheduler: ToyScheduler, max_steps: int = 10_000) -> None:
    """Steps the toy scheduler until every sequence has its tokens."""
    for _ in range(max_steps):
        batch = scheduler.schedule()
        if batch is None:
            return
        logits = runner.execute(batch)
        scheduler.update(sampler.sample(logits, batch).token_ids)
    raise RuntimeError("toy scheduler did not finish")


def greedy_run(runner, scheduler: ToyScheduler, execute=None) -> tuple[dict, dict]:
    """Greedy decoding of every sequence the toy scheduler holds: ``(req id -> its tokens,
    req id -> the logits row of its last token)``. ``execute(batch)`` runs a step (default
    ``runner.execute``)."""
    execute = execute or runner.execute
    generated: dict[int, list[int]] = {}
    last: dict = {}
    while (batch := scheduler.schedule()) is not None:
        logits = execute(batch)
        tokens = logits.argmax(-1)
        for row, req in enumerate(batch.sample_req_ids):
            generated.setdefault(int(req), []).append(int(tokens[row]))
            last[int(req)] = logits[row].clone()    # a graph's output is reused
        scheduler.update(tokens.cpu().numpy())
    return generated, last


def mixed_step(rng, num_blocks: int, block_size: int, chunks, vocab_size: int = 64):
    """One step (README arrays) over fresh sequences in shuffled blocks: ``chunks`` lists
    (context tokens before, query tokens); 1 query token is a decode row, several a prefill chunk
    or a speculative verification (rows sampled: all up to 4 query tokens, else the last). Run
    ``context_prefill(step)`` first to write the contexts' K/V."""
    free = list(rng.permutation(np.arange(1, num_blocks)))
    ids, pos, slots, qsl, lens, tables, logits = [], [], [], [0], [], [], []
    width = max(-(-(c + q) // block_size) for c, q in chunks) + 1
    for context, query in chunks:
        total = context + query
        table = [int(free.pop()) for _ in range(-(-total // block_size))]
        tables.append(table + [0] * (width - len(table)))
        p = np.arange(context, total)
        pos.extend(p.tolist())
        slots.extend((np.asarray(table)[p // block_size] * block_size + p % block_size).tolist())
        ids.extend(rng.integers(0, vocab_size, query).tolist())
        qsl.append(qsl[-1] + query)
        lens.append(total)
        logits.extend(range(qsl[-1] - query, qsl[-1]) if query <= 4 else [qsl[-1] - 1])
    return SimpleNamespace(
        input_ids=np.asarray(ids, np.int32), positions=np.asarray(pos, np.int32),
        slot_mapping=np.asarray(slots, np.int32), query_start_loc=np.asarray(qsl, np.int32),
        seq_lens=np.asarray(lens, np.int32), block_tables=np.asarray(tables, np.int32),
        logits_indices=np.asarray(logits, np.int32), block_copies=np.zeros((0, 2), np.int32))


def context_prefill(batch, block_size: int, vocab_size: int = 64):
    """The prefill step that writes every context token of ``mixed_step``'s sequences (same
    blocks and slots; sequences without context left out)."""
    qsl, lens = batch.query_start_loc, batch.seq_lens
    ids, pos, slots, q2 = [], [], [], [0]
    for i, total in enumerate(lens):
        context = int(total - (qsl[i + 1] - qsl[i]))
        p = np.arange(context)
        table = batch.block_tables[i]
        pos.extend(p.tolist())
        slots.extend((table[p // block_size] * block_size + p % block_size).tolist())
        ids.extend(((p * 7 + i) % vocab_size).tolist())
        q2.append(q2[-1] + context)
    keep = np.flatnonzero(np.diff(q2) > 0)
    q2 = np.concatenate([[0], np.cumsum(np.diff(q2)[keep])])
    return SimpleNamespace(
        input_ids=np.asarray(ids, np.int32), positions=np.asarray(pos, np.int32),
        slot_mapping=np.asarray(slots, np.int32), query_start_loc=q2.astype(np.int32),
        seq_lens=(lens[keep] - np.diff(batch.query_start_loc)[keep]).astype(np.int32),
        block_tables=batch.block_tables[keep], logits_indices=(q2[1:] - 1).astype(np.int32),
        block_copies=np.zeros((0, 2), np.int32))


def random_llama_twins(device, dtype, vocab_size: int = 512, seed: int = 0):
    """A small random Llama (3 layers, hidden 256, 8 query / 2 KV heads of 64) as a LoadedModel,
    and a deep copy of it: the same weights for two runners (each binds its own backend)."""
    import copy

    import torch

    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.loader import LoadedModel, build_model

    config = ModelConfig(arch="llama", vocab_size=vocab_size, hidden_size=256,
                         intermediate_size=512, num_layers=3, num_heads=8, num_kv_heads=2,
                         head_dim=64, max_position_embeddings=2048)
    torch.manual_seed(seed)
    model = build_model(config, None, device=torch.device(device), dtype=dtype)
    loaded = LoadedModel("tiny", config, model, None, None, "random")
    return loaded, copy.deepcopy(loaded)
