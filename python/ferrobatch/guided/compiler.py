"""GuidedCompiler: a request's guided fields -> the grammar that constrains its tokens.

A JSON Schema or a list of choices is first written as a regular expression (`json_schema`),
which the Rust core compiles into a byte-level DFA over the model's vocabulary
(`ferrobatch._scheduler.GuidedGrammar`). Each distinct pattern is compiled once and kept in a
small LRU cache, so requests with the same schema share one grammar and its per-state masks.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrobatch.guided.gbnf import gbnf_to_regex
from ferrobatch.guided.json_schema import choice_to_regex, schema_to_regex
from ferrobatch.sampling_params import SamplingParams

# Grammars kept for reuse. Each holds its DFA (<= GRAMMAR_SIZE_LIMIT_BYTES) and at most 2048
# cached state masks (12 MiB for a 49k vocabulary; `MAX_CACHED_STATES` in guided.rs), so the
# cache's memory is bounded however many distinct schemas clients send.
GRAMMAR_CACHE_SIZE = 32
# ... and at most this many bytes of DFAs in all (each grammar may take GRAMMAR_SIZE_LIMIT_BYTES,
# so 32 big schemas would otherwise keep 1 GiB): past it the least recently used go first.
GRAMMAR_CACHE_BYTES = 256 << 20
# Each of the NFA, the determinisation's working memory and the DFA; bounds a compile to well
# under a second (`AsyncEngine.prepare` runs it on a worker thread).
GRAMMAR_SIZE_LIMIT_BYTES = 32 << 20


def pattern_for(params: SamplingParams) -> str:
    """The regex whose full matches are the outputs `params` allows (ValueError if unusable)."""
    if params.guided_regex is not None:
        return params.guided_regex
    if params.guided_choice is not None:
        return choice_to_regex(list(params.guided_choice))
    if params.guided_json is not None:
        return schema_to_regex(params.guided_json)
    if params.guided_grammar is not None:
        return gbnf_to_regex(params.guided_grammar)
    raise ValueError("the request has no guided decoding field")


def _pattern_key(params: SamplingParams) -> str:
    """The cache key of a request's schema, choices or grammar (TypeError/ValueError if not JSON
    data). Not sort_keys: a schema's property order is its output's key order."""
    return json.dumps([params.guided_json, params.guided_choice, params.guided_grammar])


class GuidedCompiler:
    """Compiles guided fields into grammars over one vocabulary (thread-safe)."""

    def __init__(self, token_bytes: Sequence[bytes] | None, vocab_size: int,
                 eos_token_ids: Sequence[int], *, cache_size: int = GRAMMAR_CACHE_SIZE,
                 size_limit_bytes: int = GRAMMAR_SIZE_LIMIT_BYTES,
                 cache_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        """`token_bytes`: each token id's bytes (b"" for special tokens), None when the
        tokenizer is not byte-level (guided requests are then refused)."""
        self._token_bytes = token_bytes
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.cache_size = cache_size
        self.size_limit_bytes = size_limit_bytes
        self.cache_bytes = cache_bytes
        self._vocab: Any = None
        self._grammars: OrderedDict[str, Any] = OrderedDict()
        self._patterns: OrderedDict[str, str] = OrderedDict()   # guided field -> its regex
        self._lock = threading.Lock()
        self._think_ids: Any = None          # the ids whose bytes are `<think>` (made once)

    def _vocabulary(self) -> Any:
        if self._vocab is None:
            if self._token_bytes is None:
                raise ValueError("guided decoding needs a byte-level BPE tokenizer; this "
                                 "model's tokenizer is not one")
            if not self.eos_token_ids:
                raise ValueError("guided decoding needs an end-of-sequence token; this model "
                                 "has none")
            from ferrobatch._scheduler import TokenVocab
            self._vocab = TokenVocab(list(self._token_bytes), self.vocab_size)
        return self._vocab

    def grammar(self, pattern: str) -> Any:
        """The compiled grammar of `pattern`, from the cache when it was compiled before."""
        from ferrobatch._scheduler import GuidedGrammar

        with self._lock:
            hit = self._grammars.get(pattern)
            if hit is not None:
                self._grammars.move_to_end(pattern)
                return hit
            vocab = self._vocabulary()
        grammar = GuidedGrammar(pattern, vocab, self.eos_token_ids, self.size_limit_bytes)
        with self._lock:
            self._grammars[pattern] = grammar
            self._grammars.move_to_end(pattern)
            held = sum(g.dfa_memory_bytes for g in self._grammars.values())
            while len(self._grammars) > 1 and (len(self._grammars) > self.cache_size
                                               or held > self.cache_bytes):
                held -= self._grammars.popitem(last=False)[1].dfa_memory_bytes
        return grammar

    def cached_bytes(self) -> int:
        """Bytes of the cached grammars' DFAs (their mask caches not included)."""
        with self._lock:
            return sum(g.dfa_memory_bytes for g in self._grammars.values())

    def cached_grammar_for(self, params: SamplingParams) -> Any:
        """The grammar of a guided request if it is compiled already (None otherwise): a
        look-up that neither converts nor compiles, so it never waits on another compile."""
        pattern = params.guided_regex
        if pattern is None:
            try:
                key = _pattern_key(params)
            except (TypeError, ValueError):
                return None
            with self._lock:
                pattern = self._patterns.get(key)
        if pattern is None:
            return None
        with self._lock:
            hit = self._grammars.get(pattern)
            if hit is not None:
                self._grammars.move_to_end(pattern)
            return hit

    def grammar_for(self, params: SamplingParams) -> Any:
        """The grammar of a guided request. A schema or choice list is written as a regex once
        per distinct value (so `prepare` and `submit` do not both convert it)."""
        if params.guided_regex is not None:
            return self.grammar(params.guided_regex)
        try:
            key = _pattern_key(params)
        except (TypeError, ValueError):         # not JSON data: the converter says why
            return self.grammar(pattern_for(params))
        with self._lock:
            pattern = self._patterns.get(key)
        if pattern is None:
            pattern = pattern_for(params)
            with self._lock:
                self._patterns[key] = pattern
                while len(self._patterns) > self.cache_size:
                    self._patterns.popitem(last=False)
        return self.grammar(pattern)

    def sequences(self, params: SamplingParams) -> list[Any] | None:
        """One `GuidedSequence` per sequence of the request, at the grammar's start; None for
        an unguided request. ValueError when the grammar is bad or no token can start it."""
        if not params.is_guided:
            return None
        first = self.grammar_for(params).start()
        if first.num_allowed == 0:
            raise ValueError("no token of this model's vocabulary can start an output the "
                             "guided decoding field allows")
        return [first] + [first.copy() for _ in range(params.n - 1)]

    def after_reasoning(self, guides: list[Any], parser: str) -> list[Any]:
        """`guides` (one request's `sequences`) wrapped to apply after the reply's reasoning
        (`guided/after_reasoning.py`; `parser`: "deepseek_r1" or "qwen3")."""
        from ferrobatch.guided.after_reasoning import THINK_START, AfterReasoning
        if self._think_ids is None:
            self._think_ids = np.asarray([i for i, b in enumerate(self._token_bytes or ())
                                          if b == THINK_START], dtype=np.int64)
        return [AfterReasoning(g, parser, self._token_bytes, self._think_ids) for g in guides]

    def num_cached(self) -> int:
        with self._lock:
            return len(self._grammars)
