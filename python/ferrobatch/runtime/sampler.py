"""Batched sampler on the model's device: penalties, logit bias, token restrictions
(`allowed_token_ids`, `bad_words`), temperature, top-k/top-p/min-p, per-request seeds and
logprobs, all driven by the step's per-sample arrays.

A guided row (structured outputs) only keeps the logits of the tokens its grammar allows; that
mask is applied last, after penalties and bias. Greedy rows take the exact argmax of the
(penalised) logits. A sampled row draws its token by inverting its cumulative distribution at
one uniform number; a seeded row takes that number from a generator keyed by ``(seed,
sample_output_lens, sample_seq_indices)``, so its token depends only on that key and its own
logits row, never on the rest of the batch. Logprobs are ``log_softmax`` of the raw model logits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferrobatch.runtime.token_restrictions import apply_token_restrictions

_GOLDEN = 0x9E3779B97F4A7C15
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_MASK63 = (1 << 63) - 1


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64, the first maximum of each row; a NaN counts as the maximum),
    through numpy's vectorized argmax for float32 on the CPU: torch's took 62 us for one row of
    SmolLM2's 49,152 logits and 1.03 ms for 16, numpy's 11 us and 72 us (same indices)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return torch.from_numpy(np.ascontiguousarray(x.numpy().argmax(axis=-1), dtype=np.int64))
    return x.argmax(dim=-1)


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """``int64 [S, 2]``: each row's argmax (``argmax_rows``) and 1 when the row's sum is finite
    (no NaN / inf in it), else 0. One small tensor, so a plain greedy step on CUDA reads its
    tokens and the finite check back in one transfer; a decode CUDA graph computes it inside the
    graph (``ModelRunner.greedy_rows``)."""
    finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
    return torch.stack([argmax_rows(logits), finite.to(torch.int64)], dim=1)


@dataclass
class RequestExtras:
    """Per-request data the step arrays do not carry (looked up by request id)."""

    prompt_token_ids: Sequence[int] = ()
    output_token_ids: list[list[int]] | None = None  # per seq_index
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top-N alternatives; 0 = sampled token only
    prompt_logprobs: int | None = None   # the same for the prompt's tokens (EngineCore)
    guides: list[Any] | None = None      # per seq_index: a `GuidedSequence` (guided decoding)
    min_tokens: int = 0                  # below it, `stop_token_ids` are masked (as EOS is)
    stop_token_ids: tuple[int, ...] = ()
    allowed_mask: np.ndarray | None = None   # bool [V]: `allowed_token_ids` (token_restrictions)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()   # `bad_words` as token sequences
    pooling: Any = None      # an embedding request's `engine.pooling.PoolingState`
    # (callable, arity) pairs: `logits_processors`, run by the engine before `Sampler.sample`
    logits_processors: tuple[tuple[Any, int], ...] = ()

    @property
    def restricts_tokens(self) -> bool:
        return self.allowed_mask is not None or bool(self.bad_word_ids)

    def prompt_array(self) -> np.ndarray:
        """``prompt_token_ids`` as int64, made once (the CPU penalties read it every step)."""
        cached = self.__dict__.get("_prompt_array")
        if cached is None:
            cached = self.__dict__["_prompt_array"] = np.asarray(self.prompt_token_ids,
                                                                  dtype=np.int64)
        return cached


@dataclass
class SamplerOutput:
    """Sampled ids ``[S]`` and, when any row asked, logprobs ``[S]`` plus top-N ``[S, N]``."""

    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    top_logprob_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


def seed_for_step(seed: int, output_len: int, seq_index: int = 0) -> int:
    """Generator seed of one sampling draw: a mix of the request seed, the token position and
    which of the request's `n` sequences draws (so a seeded request's `n` samples differ)."""
    mixed = (int(seed) * 6364136223846793005) ^ ((int(output_len) + 1) * _GOLDEN)
    if seq_index:
        mixed ^= (int(seq_index) * 0xD1B54A32D192ED03) >> 1
    return mixed & _MASK63


def _drafts_before(batch, row: int) -> list[int]:
    """The draft tokens a sampled row follows: none for an ordinary row; for row ``j`` of a
    speculating sequence (its rows are consecutive, ``sample_seq_indices`` and request equal),
    its drafts ``0..j-1``, the ``j`` input tokens ending at its ``logits_indices`` entry."""
    rid, si = batch.sample_req_ids, batch.sample_seq_indices
    j = 0
    while row - j > 0 and rid[row - j - 1] == rid[row] and si[row - j - 1] == si[row]:
        j += 1
    if not j:
        return []
    end = int(batch.logits_indices[row]) + 1
    return np.asarray(batch.input_ids[end - j:end]).tolist()


def _row_output(ext: RequestExtras, batch, row: int) -> np.ndarray:
    """The output tokens a sampled row follows (int64): its sequence's, then the drafts before
    it (they are its output if the row's token is kept); empty without a token history."""
    out, seq_index = ext.output_token_ids, int(batch.sample_seq_indices[row])
    if out is None or seq_index >= len(out):
        return np.empty(0, np.int64)
    drafts = _drafts_before(batch, row)
    return np.asarray(out[seq_index] + drafts if drafts else out[seq_index], dtype=np.int64)


def _has_penalties(batch) -> bool:
    return bool(np.any(np.asarray(batch.repetition_penalty) != 1.0)
                or np.any(np.asarray(batch.presence_penalty) != 0.0)
                or np.any(np.asarray(batch.frequency_penalty) != 0.0))


class Sampler:
    """Turns logits ``[S, V]`` into one token per row following the batch's sampling arrays."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device | str,
                 seed: int | None = None, cpu_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # on the CPU, penalties, the draw of sampled rows and logprobs run on the Rust kernels
        # (`cpu_penalties.rs`, `cpu_sampling.rs`, `cpu_logprobs.rs`) on `cpu_threads` threads
        # (torch's count when None); FERROBATCH_RUST_SAMPLER=0 keeps torch's
        self.rust_kernels = (self.device.type == "cpu"
                             and os.environ.get("FERROBATCH_RUST_SAMPLER", "1") != "0")
        self.cpu_threads = cpu_threads or torch.get_num_threads()
        self.eos_token_ids = torch.tensor(list(eos_token_ids), dtype=torch.int64, device=self.device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def _row_tensor(self, batch, name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(getattr(batch, name))).to(self.device, dtype)

    # -- logits processing --------------------------------------------------------------------
    def _token_counts(self, batch, extras, rows: np.ndarray, with_prompt: bool) -> torch.Tensor:
        """``[S, V]`` counts of output tokens (plus prompt tokens when asked) for ``rows``."""
        counts = torch.zeros(len(batch.sample_req_ids), self.vocab_size, device=self.device)
        row_ids, token_ids = [], []
        for row in rows:
            ext = extras.get(int(batch.sample_req_ids[row])) if extras else None
            if ext is None:
                continue
            output = _row_output(ext, batch, row)
            tokens = np.concatenate([ext.prompt_array(), output]) if with_prompt else output
            row_ids.append(np.full(len(tokens), row, dtype=np.int64))
            token_ids.append(tokens)
        if row_ids:
            index = (torch.from_numpy(np.concatenate(row_ids)).to(self.device),
                     torch.from_numpy(np.concatenate(token_ids)).to(self.device))
            counts.index_put_(index, torch.ones(index[0].shape[0], device=self.device), accumulate=True)
        return counts

    def _apply_penalties(self, logits: torch.Tensor, batch, extras) -> None:
        rep = np.asarray(batch.repetition_penalty)
        pres = np.asarray(batch.presence_penalty)
        freq = np.asarray(batch.frequency_penalty)
        if self.rust_kernels and logits.dtype == torch.float32 and logits.is_contiguous():
            self._apply_penalties_rust(logits, batch, extras, rep, pres, freq)
            return
        rep_rows = np.flatnonzero(rep != 1.0)
        if rep_rows.size:
            seen = self._token_counts(batch, extras, rep_rows, with_prompt=True) > 0
            penalty = self._row_tensor(batch, "repetition_penalty", torch.float32)[:, None]
            # a tiny penalty must not overflow a logit to inf (the softmax would give NaN)
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty).clamp_(
                min=-FLOAT32_MAX, max=FLOAT32_MAX)
            logits.copy_(torch.where(seen, penalised, logits))
        additive_rows = np.flatnonzero((pres != 0.0) | (freq != 0.0))
        if additive_rows.size:
            counts = self._token_counts(batch, extras, additive_rows, with_prompt=False)
            logits -= self._row_tensor(batch, "frequency_penalty", torch.float32)[:, None] * counts
            logits -= self._row_tensor(batch, "presence_penalty", torch.float32)[:, None] * (counts > 0)

    def _apply_penalties_rust(self, logits: torch.Tensor, batch, extras, rep: np.ndarray,
                              pres: np.ndarray, freq: np.ndarray) -> None:
        """``_apply_penalties``' arithmetic, value for value, on the CPU kernels' threads
        (``_scheduler.apply_penalties_f32``): per row, work in proportion to its tokens rather
        than passes over a ``[S, V]`` count tensor."""
        from ferrobatch._scheduler import apply_penalties_f32

        rows = logits.shape[0]
        spans = np.zeros((rows, 4), np.int64)
        pieces: list[np.ndarray] = []
        pos = 0
        for row in np.flatnonzero((rep != 1.0) | (pres != 0.0) | (freq != 0.0)):
            ext = extras.get(int(batch.sample_req_ids[row])) if extras else None
            if ext is None:
                continue
            output = _row_output(ext, batch, row)
            # laid out [prompt, output]: repetition reads both, frequency / presence the output
            start = pos
            if rep[row] != 1.0:
                prompt = ext.prompt_array()
                pieces.append(prompt)
                pos += prompt.size
            pieces.append(output)
            spans[row] = (start, pos + output.size, pos, pos + output.size)
            pos += output.size
        tokens = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
        apply_penalties_f32(logits.numpy(), np.ascontiguousarray(rep, np.float32),
                            np.ascontiguousarray(freq, np.float32),
                            np.ascontiguousarray(pres, np.float32), tokens, spans,
                            self.cpu_threads)

    def _apply_logit_bias(self, logits: torch.Tensor, batch, extras) -> None:
        rows, tokens, values = [], [], []
        for row, req_id in enumerate(batch.sample_req_ids):
            ext = extras.get(int(req_id))
            if ext is not None and ext.logit_bias:
                for token, bias in ext.logit_bias.items():
                    if not 0 <= int(token) < self.vocab_size:
                        raise ValueError(f"logit_bias token id {token} outside the vocabulary")
                    rows.append(row)
                    tokens.append(int(token))
                    values.append(float(bias))
        if rows:
            index = (torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device))
            logits.index_put_(index, torch.tensor(values, device=self.device), accumulate=True)

    def _mask_stop_token_ids(self, logits: torch.Tensor, batch, extras) -> None:
        """Below `min_tokens` a request's stop token ids cannot be sampled, as its EOS ids
        cannot (the scheduler only ends a sequence on them from token min_tokens + 1 on)."""
        rows, tokens = [], []
        out_lens = batch.sample_output_lens
        for row, req_id in enumerate(batch.sample_req_ids):
            ext = extras.get(int(req_id))
            if ext is not None and ext.stop_token_ids and out_lens[row] < ext.min_tokens:
                rows.extend([row] * len(ext.stop_token_ids))
                tokens.extend(ext.stop_token_ids)
        if rows:
            logits[torch.tensor(rows, device=self.device),
                   torch.tensor(tokens, device=self.device)] = float("-inf")

    def _apply_restrictions(self, logits: torch.Tensor, batch, extras) -> None:
        """`allowed_token_ids` and `bad_words` (``token_restrictions``); a speculative row's
        history includes the drafts before it."""
        rows = []
        for row, (rid, si) in enumerate(zip(np.asarray(batch.sample_req_ids).tolist(),
                                            np.asarray(batch.sample_seq_indices).tolist())):
            ext = extras.get(rid)
            if ext is None or not ext.restricts_tokens:
                continue
            history: list[int] = []
            if ext.bad_word_ids:
                history = ext.output_token_ids[si] + _drafts_before(batch, row)
            rows.append((row, ext, history))
        apply_token_restrictions(logits, rows)

    def _apply_guides(self, logits: torch.Tensor, batch, extras) -> None:
        """Keeps, in each guided row, only the logits of the tokens its grammar allows next.

        Row ``j > 0`` of a sequence is a speculative row that follows drafts ``0..j-1``
        (``_drafts_before``), so its mask is the grammar's after them. A draft the grammar refuses cannot be kept (the row before it
        draws only allowed tokens), so the rows after it keep the last mask: their tokens are
        never used, and no row is ever left without an allowed token (nor is a row after a
        draft that ends the grammar, which ends the sequence)."""
        rows, guides = [], []
        guide = None
        for row, (rid, si) in enumerate(zip(np.asarray(batch.sample_req_ids).tolist(),
                                            np.asarray(batch.sample_seq_indices).tolist())):
            ext = extras.get(rid)
            if ext is None or not ext.guides:
                continue
            drafts = _drafts_before(batch, row)
            if not drafts:
                guide = ext.guides[si]
            else:
                after = guide.copy()
                if after.advance(drafts[-1]) and after.num_allowed > 0:
                    guide = after
            rows.append(row)
            guides.append(guide)
        if not rows:
            return
        allowed = np.zeros((len(rows), logits.shape[1]), dtype=bool)
        for k, guide in enumerate(guides):
            guide.write_mask(allowed[k])
        index = torch.tensor(rows, device=self.device)
        mask = torch.from_numpy(allowed).to(self.device)
        logits[index] = logits[index].masked_fill(~mask, float("-inf"))

    def _mask_top_k_top_p(self, logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
        """Keeps each row's ``top_k`` highest logits (all for 0), then, over those renormalized,
        the smallest prefix of the descending order whose mass reaches ``top_p`` (at least one
        token); every other logit becomes -inf.

        Only the candidates are sorted (``topk``): a full sort of SmolLM2's 49,152 logits took
        ~2 ms per row. The candidate count starts at the largest ``top_k`` (or 64) and grows
        x4 until every top-p row's nucleus ends inside it; a flat distribution ends in a full
        sort, as before."""
        vocab = self.vocab_size
        k_row = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
        limited = np.flatnonzero((k_row < vocab) | (top_p < 1.0))   # rows that lose tokens
        if limited.size < logits.shape[0]:
            out = logits.clone()
            index = torch.from_numpy(limited).to(self.device)
            out[index] = self._mask_top_k_top_p(logits[index], top_k[limited], top_p[limited])
            return out
        fixed = k_row[k_row < vocab]
        count = int(min(vocab, max(64, int(fixed.max()) if fixed.size else 0)))
        p = torch.from_numpy(top_p.astype(np.float32)).to(self.device)[:, None]
        k = torch.from_numpy(k_row).to(self.device)[:, None]
        # rows without top-k renormalize over every logit: their log-normalizer, computed once
        full_lse = logits.logsumexp(dim=-1, keepdim=True) if fixed.size < k_row.size else None
        while True:
            values, order = logits.topk(count, dim=-1)
            ranks = torch.arange(count, device=self.device)[None, :]
            remove = ranks >= k
            kept = values.masked_fill(remove, float("-inf"))
            lse = kept.logsumexp(dim=-1, keepdim=True)
            if full_lse is not None:
                lse = torch.where(k < vocab, lse, full_lse)
            probs = (kept - lse).exp()
            mass = probs.cumsum(dim=-1)
            remove |= (mass - probs) > p
            # a row is settled when its cut falls inside the candidates: top-k within them, or
            # the candidates' mass already past top_p (so every later token is cut too)
            settled = (k <= count) | (mass[:, -1:] > p)
            if count == vocab or bool(settled.all()):
                break
            count = min(vocab, count * 4)
        out = torch.full_like(logits, float("-inf"))
        return out.scatter_(1, order, values.masked_fill(remove, float("-inf")))

    def _draw(self, probs: torch.Tensor, seeds: np.ndarray, output_lens: np.ndarray,
              seq_indices: np.ndarray) -> torch.Tensor:
        """One token per row of ``probs`` (unnormalized, non-negative) by the inverse of its
        cumulative distribution at one uniform draw: a seeded row's from its own generator (keyed
        by seed, output length and sequence index), the others' from the sampler's."""
        uniform = self._uniforms(probs.shape[0], seeds, output_lens, seq_indices)
        cdf = probs.double().cumsum(dim=-1)
        # a point in (0, total]: the first index whose cumulative mass reaches it has p > 0
        target = (1.0 - uniform) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, target).clamp_(max=probs.shape[1] - 1)
        return tokens[:, 0]

    def _uniforms(self, rows: int, seeds: np.ndarray, output_lens: np.ndarray,
                  seq_indices: np.ndarray) -> torch.Tensor:
        """Each row's uniform draw in [0, 1) (float64 ``[rows, 1]``): a seeded row's from its
        own generator (keyed by seed, output length and sequence index), the others' from the
        sampler's."""
        uniform = torch.rand(rows, 1, generator=self.generator, dtype=torch.float64,
                             device=self.device)
        for row in np.flatnonzero(seeds >= 0):
            gen = torch.Generator(device=self.device).manual_seed(
                seed_for_step(seeds[row], output_lens[row], seq_indices[row]))
            uniform[row] = torch.rand(1, generator=gen, dtype=torch.float64, device=self.device)
        return uniform

    def _sample_rust(self, logits: torch.Tensor, batch, temperature: np.ndarray) -> torch.Tensor:
        """``_sample_random``'s distribution and draw rule, each row in a few passes on the
        CPU kernels' threads (``_scheduler.sample_rows_f32``; a top-p row of 49,152 logits took
        ~1.3 ms in torch), at the same uniform numbers; greedy rows get their argmax."""
        from ferrobatch._scheduler import sample_rows_f32

        rows = logits.shape[0]
        uniform = self._uniforms(rows, np.asarray(batch.seed), np.asarray(batch.sample_output_lens),
                                 np.asarray(batch.sample_seq_indices))
        out = np.empty(rows, np.int64)
        sample_rows_f32(logits.contiguous().numpy(), np.ascontiguousarray(temperature, np.float32),
                        np.ascontiguousarray(batch.top_k, np.int32),
                        np.ascontiguousarray(batch.top_p, np.float32),
                        np.ascontiguousarray(batch.min_p, np.float32),
                        uniform[:, 0].numpy(), out, self.cpu_threads)
        return torch.from_numpy(out)

    # -- API ----------------------------------------------------------------------------------
    @staticmethod
    def is_plain_greedy(batch, extras: Mapping[int, RequestExtras] | None = None) -> bool:
        """Whether ``sample`` would return each row's argmax of the raw logits and nothing else
        (every row greedy; no penalty, bias, guide, suppressed EOS, stop-token mask or
        logprobs): then ``greedy_rows`` of the logits is the whole sample."""
        if not bool(np.all(np.asarray(batch.temperature) <= 0.0)) or _has_penalties(batch) \
                or np.asarray(batch.suppress_eos).astype(bool).any():
            return False
        return not any(e.logit_bias or e.guides or (e.min_tokens and e.stop_token_ids)
                       or e.logprobs is not None or e.restricts_tokens or e.logits_processors
                       for e in (extras or {}).values())

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch,
               extras: Mapping[int, RequestExtras] | None = None) -> SamplerOutput:
        """Samples one token per row of ``logits [S, V]`` (float32) using the batch's arrays."""
        num_samples = logits.shape[0]
        if num_samples == 0:
            return SamplerOutput(token_ids=np.empty(0, dtype=np.int32))
        extras = extras or {}
        raw_logits = logits.float()
        temperature = np.asarray(batch.temperature, dtype=np.float32)
        has_penalties = _has_penalties(batch)
        has_bias = any(e.logit_bias for e in extras.values())
        has_guides = any(e.guides for e in extras.values())
        suppress = np.asarray(batch.suppress_eos).astype(bool)
        has_stop_masks = any(e.min_tokens and e.stop_token_ids for e in extras.values())
        has_restrictions = any(e.restricts_tokens for e in extras.values())
        all_greedy = bool(np.all(temperature <= 0.0))
        if all_greedy and not (has_penalties or has_bias or has_guides or suppress.any()
                               or has_stop_masks or has_restrictions):
            tokens = argmax_rows(raw_logits)
        else:
            rust_draw = self.rust_kernels and raw_logits.dtype == torch.float32 and not all_greedy
            # the logits are the caller's: copied before anything writes them (the torch draw
            # scales its rows in place; the Rust one only reads)
            modified = (has_penalties or has_bias or has_guides or bool(suppress.any())
                        or has_stop_masks or has_restrictions)
            logits = raw_logits.clone() if modified or not rust_draw else raw_logits
            if has_bias:
                self._apply_logit_bias(logits, batch, extras)
            if has_penalties:
                self._apply_penalties(logits, batch, extras)
            if has_restrictions:
                self._apply_restrictions(logits, batch, extras)
            if suppress.any() and self.eos_token_ids.numel():
                rows = torch.from_numpy(np.flatnonzero(suppress)).to(self.device)
                logits[rows[:, None], self.eos_token_ids[None, :]] = float("-inf")
            if has_stop_masks:
                self._mask_stop_token_ids(logits, batch, extras)
            if has_guides:
                self._apply_guides(logits, batch, extras)
            if all_greedy:
                tokens = argmax_rows(logits)
            elif rust_draw:
                tokens = self._sample_rust(logits, batch, temperature)
                if np.any(temperature <= 0.0):     # torch's argmax (NaN and all) for those
                    tokens = torch.where(torch.from_numpy(temperature <= 0.0), argmax_rows(logits),
                                         tokens)
            else:
                tokens = torch.where(
                    torch.from_numpy(temperature <= 0.0).to(self.device), argmax_rows(logits),
                    self._sample_random(logits, batch, temperature))
        return self._with_logprobs(tokens, raw_logits, batch, extras)

    def _sample_random(self, logits: torch.Tensor, batch, temperature: np.ndarray) -> torch.Tensor:
        """One drawn token per row; scales `logits` (the caller's working copy) in place."""
        safe_t = torch.from_numpy(np.where(temperature > 0.0, temperature, 1.0)).to(self.device)
        # shifted so the largest is 0 first: a tiny temperature then sends the others to -inf
        # (near-greedy) instead of every logit to +-inf (NaN probabilities, a garbage token).
        # In place: `logits` is the sampler's own copy, and a batch's rows are tens of MB.
        scaled = logits.sub_(logits.amax(dim=-1, keepdim=True)).div_(safe_t[:, None])
        top_k = np.asarray(batch.top_k)
        top_p = np.asarray(batch.top_p, dtype=np.float32)
        if np.any(top_k > 0) or np.any(top_p < 1.0):
            scaled = self._mask_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        min_p = np.asarray(batch.min_p, dtype=np.float32)
        if np.any(min_p > 0.0):
            threshold = torch.from_numpy(min_p).to(self.device)[:, None] * probs.max(-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return self._draw(probs, np.asarray(batch.seed), np.asarray(batch.sample_output_lens),
                          np.asarray(batch.sample_seq_indices))

    def _with_logprobs(self, tokens: torch.Tensor, raw_logits: torch.Tensor, batch,
                       extras: Mapping[int, RequestExtras]) -> SamplerOutput:
        wanted = [extras[int(r)].logprobs for r in batch.sample_req_ids
                  if int(r) in extras and extras[int(r)].logprobs is not None] if extras else []
        token_ids = tokens.to(torch.int32).cpu().numpy()
        if not wanted:
            return SamplerOutput(token_ids=token_ids)
        top_n = max(wanted)
        fast = self.cpu_logprobs(raw_logits, token_ids, top_n)
        if fast is not None:
            chosen, top_ids, top_values = fast
            return SamplerOutput(token_ids=token_ids, logprobs=chosen,
                                 top_logprob_ids=top_ids.astype(np.int32), top_logprobs=top_values)
        logprobs = raw_logits.log_softmax(dim=-1)
        sampled = logprobs.gather(1, tokens[:, None].long())[:, 0]
        top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (
            logprobs[:, :0], torch.empty(tokens.shape[0], 0, dtype=torch.int64, device=self.device))
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=sampled.cpu().numpy().astype(np.float32),
            top_logprob_ids=top_ids.to(torch.int32).cpu().numpy(),
            top_logprobs=top_values.cpu().numpy().astype(np.float32),
        )

    def cpu_logprobs(self, logits: torch.Tensor, tokens: np.ndarray, top_n: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The logprobs of ``tokens[r]`` under each row of ``logits`` ``[S, V]`` and each row's
        ``top_n`` most likely tokens with theirs (float32 ``[S]``, int64 ``[S, top_n]``, float32
        ``[S, top_n]``), on the CPU kernels' threads (``_scheduler.logprobs_rows_f32``: per row
        its normalizer and top tokens in two passes, where torch wrote a whole ``log_softmax``
        and ran ``topk`` over it; equal logits rank by lower token id). None where the kernel
        does not apply (CUDA, other dtypes, ``FERROBATCH_RUST_SAMPLER=0``): use torch."""
        if not (self.rust_kernels and logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.dim() == 2 and top_n <= logits.shape[1]):
            return None
        from ferrobatch._scheduler import logprobs_rows_f32

        rows = logits.shape[0]
        chosen = np.empty(rows, np.float32)
        top_ids = np.empty((rows, top_n), np.int64)
        top_values = np.empty((rows, top_n), np.float32)
        logprobs_rows_f32(logits.contiguous().numpy(), np.asarray(tokens, np.int64), chosen,
                          top_ids, top_values, self.cpu_threads)
        return chosen, top_ids, top_values
