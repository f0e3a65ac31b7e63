"""SamplingParams: how to sample one request (vLLM-compatible names), validated on construction.

Range checks live here; checks that need the model (vocabulary size, context length, engine caps)
live in `SamplingParams.check_against` and run before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import struct
from dataclasses import dataclass
from typing import Any

OUTPUT_KINDS = ("cumulative", "delta", "final")
MAX_SEED = 2**63 - 1
MAX_PRIORITY = 2**31 - 1
MAX_LOGPROBS = 20     # top alternatives per position (OpenAI's chat limit)
MAX_GUIDED_CHOICES = 1024
MAX_GUIDED_TEXT_CHARS = 1 << 16   # a regex, a choice, a JSON schema's or a grammar's text
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 18


# fields where None (as vLLM takes it) means the default
_NONE_IS_DEFAULT = ("n", "min_tokens", "temperature", "top_k", "top_p", "min_p",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                    "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                    "skip_special_tokens", "priority", "output_kind", "bad_words",
                    "logits_processors")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_DECIMAL = re.compile(r"\s*[+-]?[0-9]+\s*")        # a token id as text (JSON object keys)


def _as_float32(v: float) -> float:
    """`v` as the Rust core stores it (float32): a positive value below its range becomes 0."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except (OverflowError, struct.error):   # beyond float32 (or a float): the range checks
        return math.inf if v > 0 else -math.inf   # refuse it


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request.

    `temperature=0` is greedy. `top_k` 0 or -1 disables top-k. `max_tokens=None` fills the
    context window. `logprobs`: None for none, else each generated token's log-probability plus
    that many top alternatives (0..20; see `TokenLogprob`). `prompt_logprobs`: the same for every
    prompt token after the first (such a request skips the prefix cache: a cached token has no
    logits). `priority`: lower runs first under the "priority" policy. `output_kind` chooses what
    `AsyncEngine.generate` yields: the whole text so far ("cumulative"), only what is new since
    the previous yield ("delta"), or a single final output ("final").

    Token restrictions (vLLM's): `allowed_token_ids` — only these tokens may be generated (EOS
    too only if listed); `bad_words` — words never generated: each is tokenized as written and
    with a leading space, and the last token of such a sequence is masked wherever the output
    so far ends with the tokens before it. `truncate_prompt_tokens` keeps only the prompt's last
    that many tokens (-1: as many as fit beside `max_tokens`, or one output token when it is
    None) instead of refusing a prompt that is too long.

    `cache_salt` (vLLM's, there passed beside the prompt): the request's prompt blocks are
    shared through the prefix cache only with requests of the same salt, so tenants cannot
    probe each other's prompts by timing (use a long random secret per tenant).

    Guided decoding (structured outputs), at most one of: `guided_json` (a JSON Schema as a
    dict or JSON text; `{"type": "object"}` is any JSON object), `guided_regex` (the output is a
    full match of this regex, Rust regex syntax), `guided_choice` (the output is exactly one of
    these strings), `guided_grammar` (a GBNF grammar, llama.cpp's format, from its `root`
    rule; recursion is expanded 3 deep, `guided/gbnf.py`). Only tokens that keep the output a prefix of a valid text are sampled, and
    end-of-sequence only where it is complete; `ignore_eos` and `min_tokens` cannot be combined
    with it (the grammar decides where the output ends).

    `logits_processors` (vLLM's, Python module only): callables ``fn(output_token_ids, logits)``
    or ``fn(prompt_token_ids, output_token_ids, logits)`` returning the logits row to sample
    from, run in order on every generated token of each sequence before the sampler's own steps
    (`runtime/logits_processors.py`); a processor that raises fails its request only. Such a
    request does not draft speculatively (a processor may keep state between calls).
    `extra_args` (vLLM's; the HTTP body's `vllm_xargs`): named values for the engine-wide
    processors (`EngineConfig.logits_processors`), which decide from them whether and how to
    act on the request; the engine itself reads nothing in it.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    output_kind: str = "cumulative"
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    logits_processors: tuple[Any, ...] = ()
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        def fix(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for f in dataclasses.fields(self):        # vLLM's spellings: None, numpy scalars
            v = getattr(self, f.name)
            if v is None and f.name in _NONE_IS_DEFAULT:
                fix(f.name, f.default)
            elif isinstance(v, numbers.Integral) and not isinstance(v, (int, bool)):
                fix(f.name, int(v))
            elif isinstance(v, numbers.Real) and not isinstance(v, (int, float, bool)):
                fix(f.name, float(v))
        if self.seed == -1:                       # vLLM: -1 is no seed
            fix("seed", None)

        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        if not _is_num(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k!r}")
        if self.top_k == -1:
            fix("top_k", 0)
        if not _is_num(self.top_p) or not (0.0 < _as_float32(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_num(self.repetition_penalty) or not (
                0.0 < _as_float32(self.repetition_penalty) <= 10.0):
            raise ValueError(f"repetition_penalty must be a number in (0, 10], got "
                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed <= MAX_SEED)):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        fix("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        fix("stop_token_ids", tuple(ids))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a map of token id -> bias")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                # an int, or its decimal text (JSON object keys are strings); not 1.7 or True
                if _is_int(k):
                    tok = k
                elif isinstance(k, str) and _DECIMAL.fullmatch(k):
                    tok = int(k)
                else:
                    raise ValueError(f"logit_bias key {k!r} is not a token id")
                if tok < 0 or not _is_num(v) or not (-100.0 <= v <= 100.0):
                    raise ValueError(f"logit_bias[{k!r}] must be a number in [-100, 100]")
                bias[tok] = float(v)
            fix("logit_bias", bias or None)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or None), "
                                 f"got {v!r}")
        self._check_token_restrictions(fix)
        if not _is_int(self.priority) or abs(self.priority) > MAX_PRIORITY:
            raise ValueError(f"priority must be a 32-bit integer, got {self.priority!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        self._check_guided(fix)
        self._check_logits_processors(fix)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise ValueError(f"{name} must be finite")
            fix(name, float(v))

    def _check_logits_processors(self, fix: Any) -> None:
        fns = self.logits_processors
        if callable(fns):
            fns = (fns,)
        if not isinstance(fns, (tuple, list)):
            raise ValueError("logits_processors must be a list of callables")
        if fns:
            from ferrobatch.runtime.logits_processors import processor_arity
            for fn in fns:
                processor_arity(fn)             # ValueError for one that cannot be called so
        fix("logits_processors", tuple(fns))
        extra = self.extra_args
        if extra is not None:
            if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
                raise ValueError("extra_args must be a map of names (strings) to values")
            fix("extra_args", dict(extra) or None)

    def _check_token_restrictions(self, fix: Any) -> None:
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (tuple, list)) or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError("allowed_token_ids must be a list of non-negative integers")
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} ids")
            fix("allowed_token_ids", tuple(ids))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, (tuple, list)) or not all(isinstance(w, str) for w in words):
            raise ValueError("bad_words must be a list of strings")
        if any(not w.strip() for w in words):
            raise ValueError("bad_words must not hold empty or blank strings")
        if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in words):
            raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words of at most "
                             f"{MAX_BAD_WORD_CHARS} characters")
        fix("bad_words", tuple(words))
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 256):
            raise ValueError("cache_salt must be a string of 1 to 256 characters")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t == -1 or t >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 (or -1: as many "
                             f"as fit), got {t!r}")

    def _check_guided(self, fix: Any) -> None:
        given = [n for n in GUIDED_FIELDS if getattr(self, n) is not None]
        if not given:
            return
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(GUIDED_FIELDS)} may be set, got "
                             f"{', '.join(given)}")
        if self.guided_grammar is not None:
            if not isinstance(self.guided_grammar, str) or not self.guided_grammar.strip():
                raise ValueError("guided_grammar must be a non-empty GBNF text")
            if len(self.guided_grammar) > MAX_GUIDED_TEXT_CHARS:
                raise ValueError(f"guided_grammar is longer than {MAX_GUIDED_TEXT_CHARS} "
                                 "characters")
        if self.guided_regex is not None:
            if not isinstance(self.guided_regex, str) or not self.guided_regex:
                raise ValueError("guided_regex must be a non-empty string")
            if len(self.guided_regex) > MAX_GUIDED_TEXT_CHARS:
                raise ValueError(f"guided_regex is longer than {MAX_GUIDED_TEXT_CHARS} characters")
        if self.guided_choice is not None:
            choices = self.guided_choice
            if not isinstance(choices, (list, tuple)) or not choices \
                    or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("guided_choice must be a non-empty list of non-empty strings")
            if len(choices) > MAX_GUIDED_CHOICES or \
                    sum(len(c) for c in choices) > MAX_GUIDED_TEXT_CHARS:
                raise ValueError(f"guided_choice may hold at most {MAX_GUIDED_CHOICES} strings "
                                 f"of {MAX_GUIDED_TEXT_CHARS} characters in all")
            fix("guided_choice", tuple(choices))
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str) and len(schema) > MAX_GUIDED_TEXT_CHARS:
                raise ValueError(f"guided_json is longer than {MAX_GUIDED_TEXT_CHARS} characters")
            if not isinstance(schema, (dict, str, bool)):
                raise ValueError("guided_json must be a JSON Schema (an object, or its JSON text)")
        if self.allowed_token_ids is not None:
            raise ValueError(f"{given[0]} cannot be combined with allowed_token_ids: the "
                             "grammar decides which tokens may come")
        if self.ignore_eos:
            raise ValueError(f"{given[0]} cannot be combined with ignore_eos: the grammar "
                             "decides where the output ends")
        if self.min_tokens:
            raise ValueError(f"{given[0]} cannot be combined with min_tokens: the grammar "
                             "decides where the output ends")

    @property
    def is_guided(self) -> bool:
        """True when a grammar (JSON Schema, regex, choice or GBNF) constrains the output."""
        return (self.guided_json is not None or self.guided_regex is not None
                or self.guided_choice is not None or self.guided_grammar is not None)

    def clone(self) -> "SamplingParams":
        """A copy (vLLM's name; the params are immutable, so `replace` makes changed ones)."""
        return dataclasses.replace(self)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    @property
    def allows_speculation(self) -> bool:
        """True when prompt-lookup drafts may be checked for this request in one step: one
        sequence, and no logits processors (they may keep state between calls). Each drafted row's token is drawn from that row's own distribution (bias
        applied, penalties counting the drafts before it, the grammar's mask after them,
        logprobs taken from it), and keeping drafts while the drawn token equals them is exact
        speculative sampling for a draft that is one fixed token: a draft survives with its
        probability, and a refused one leaves a draw from the rest. Greedy and seeded outputs
        are the very tokens the engine gives without drafts (a seeded row's draw is keyed by
        its position)."""
        return self.n == 1 and not self.logits_processors

    @property
    def needs_token_history(self) -> bool:
        """True when the sampler needs this request's generated tokens (penalties, bad words,
        logits processors)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.bad_words)
                or bool(self.logits_processors))

    def truncated_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """`ids` cut to their last `truncate_prompt_tokens` (ValueError when that is more than
        the context window holds); `ids` unchanged when it is not set."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep == -1:
            keep = max_model_len - (self.max_tokens or 1)
            if keep < 1:
                raise ValueError(f"max_tokens ({self.max_tokens}) leaves no room for a prompt "
                                 f"in the {max_model_len}-token context window")
        elif keep >= max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({keep}) must be below the context "
                             f"window of {max_model_len} tokens")
        return ids[-keep:]

    def check_against(self, *, prompt_len: int, max_model_len: int, vocab_size: int,
                      max_n: int, max_stop_strings: int, max_stop_string_len: int,
                      max_stop_token_ids: int, max_logit_bias: int) -> int:
        """Check the limits that depend on the engine; returns the effective max_tokens."""
        if self.n > max_n:
            raise ValueError(f"n must be <= {max_n}, got {self.n}")
        if len(self.stop) > max_stop_strings:
            raise ValueError(f"at most {max_stop_strings} stop strings are allowed, "
                             f"got {len(self.stop)}")
        if any(len(s) > max_stop_string_len for s in self.stop):
            raise ValueError(f"stop strings must be at most {max_stop_string_len} characters")
        if len(self.stop_token_ids) > max_stop_token_ids:
            raise ValueError(f"at most {max_stop_token_ids} stop_token_ids are allowed")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:4]} are outside the vocabulary "
                             f"(size {vocab_size})")
        if self.allowed_token_ids is not None and max(self.allowed_token_ids) >= vocab_size:
            raise ValueError(f"allowed_token_ids must be token ids below {vocab_size}")
        if self.logit_bias:
            if len(self.logit_bias) > max_logit_bias:
                raise ValueError(f"logit_bias may hold at most {max_logit_bias} entries")
            if any(t >= vocab_size for t in self.logit_bias):
                raise ValueError(f"logit_bias keys must be token ids below {vocab_size}")
        if prompt_len >= max_model_len:
            raise ValueError(f"the prompt is {prompt_len} tokens long; this model's context "
                             f"window is {max_model_len} tokens (prompt + output)")
        room = max_model_len - prompt_len
        if self.max_tokens is None:
            if self.min_tokens > room:
                raise ValueError(f"min_tokens ({self.min_tokens}) does not fit: only {room} "
                                 f"tokens left in the {max_model_len}-token context")
            return room
        if self.max_tokens > room:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) "
                             f"exceeds the context window of {max_model_len} tokens")
        return self.max_tokens
