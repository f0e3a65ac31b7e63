"""Tokenizer: a ``tokenizers`` BPE built from GGUF metadata (byte-level, or SentencePiece's:
``spm_vocab``) or a tokenizer.json.

Special tokens written in the text (e.g. ``<|im_start|>``) are parsed as specials. The "smollm"
(and "starcoder") pre-tokenizer isolates every digit before the GPT-2 split, like llama.cpp.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ferrobatch.model.chat_template import render_chat_template

_TOKEN_TYPE_CONTROL = 3
# Texts at least this long are encoded through `encode_batch`, which releases the GIL: the step
# thread keeps running meanwhile, and a caller can encode on a worker thread without stalling
# the event loop (a 1 MiB prompt takes ~0.7 s here).
LONG_TEXT_CHARS = 8192
_TOKEN_TYPE_USER_DEFINED = 4
# End-of-generation markers (llama.cpp's EOG set); generation stops on any present in the vocabulary.
_EOG_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
              "<end_of_turn>", "<|eom_id|>")
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral's Tekken (Mistral NeMo, Ministral, Mistral Small 3): cased words split at their
# capitals, no contractions, single digits, "/" kept with the punctuation before it
_TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k split (GPT-4o; Phi-4-mini's vocabulary): Tekken's words with contractions
# attached, digits in threes
_GPT4O_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _GPT4O_CONTRACTION +
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _GPT4O_CONTRACTION +
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# llama.cpp's pre-tokenizer names -> the split expression it uses for them (several names
# share one: DeepSeek-R1's Qwen distills say "deepseek-r1-qwen", Falcon 3 "falcon3", ...)
_PRE_TOKENIZER_REGEX = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"),
                    _LLAMA3_REGEX),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_REGEX),
    "tekken": _TEKKEN_REGEX,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_REGEX),
}
# Llama 3's and Tekken's vocabularies take a whole word that is a token as it is, merges or
# not (tokenizer.json's "ignore_merges": true; llama.cpp does the same for these names)
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "tekken")
# ... and start with BOS where the file does not say (llama.cpp's default for these names)
BOS_BY_DEFAULT = _IGNORE_MERGES


def _reject_lone_surrogates(text: str) -> None:
    """ValueError if ``text`` holds a lone UTF-16 surrogate (JSON's "\\ud800" decodes to one):
    it is not a Unicode character, so no tokenizer can encode it."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate (U+{ord(text[exc.start]):04X}), "
                         "which is not valid Unicode") from None


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    regex = _PRE_TOKENIZER_REGEX.get(pre)
    if regex is None:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


class Tokenizer:
    """Text <-> token ids, special tokens, end-of-generation ids and the chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._plain_text_backend: HFTokenizer | None = None  # specials encoded as text; built lazily
        self._byte_tables: dict[bool, list[bytes] | None] = {}  # skip_special_tokens -> table
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        eog = [] if eos_token_id is None else [eos_token_id]
        for text in _EOG_TEXTS:
            token_id = backend.token_to_id(text)
            if token_id is not None and token_id not in eog:
                eog.append(token_id)
        eog += [i for i in extra_eos_token_ids if i not in eog]
        self.eos_token_ids: list[int] = eog

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: Any) -> Tokenizer:
        """Builds from ``GGUFTokenizerMetadata``: byte-level BPE (``tokenizer.ggml.model ==
        "gpt2"``) or SentencePiece (``"llama"``, ``model.spm_vocab``)."""
        if meta.model == "llama":
            from ferrobatch.model.spm_vocab import spm_backend
            return cls(spm_backend(meta), bos_token_id=meta.bos_token_id,
                       eos_token_id=meta.eos_token_id, add_bos_token=meta.add_bos_token,
                       chat_template=meta.chat_template)
        if meta.model != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {meta.model!r} (byte-level BPE 'gpt2' and "
                "SentencePiece 'llama' are supported)"
            )
        vocab = {token: i for i, token in enumerate(meta.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.merges]
        backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False,
                                         ignore_merges=meta.pre in _IGNORE_MERGES))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.pre)
        backend.decoder = decoders.ByteLevel()
        types = meta.token_types or [1] * len(meta.tokens)
        added = [
            AddedToken(meta.tokens[i], special=(t == _TOKEN_TYPE_CONTROL), normalized=False)
            for i, t in enumerate(types) if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        ]
        backend.add_special_tokens([a for a in added if a.special])
        backend.add_tokens([a for a in added if not a.special])
        return cls(backend, bos_token_id=meta.bos_token_id, eos_token_id=meta.eos_token_id,
                   add_bos_token=meta.add_bos_token, chat_template=meta.chat_template)

    @classmethod
    def from_hf_files(
        cls, tokenizer_json: str | os.PathLike, tokenizer_config: dict[str, Any] | None = None,
        generation_eos_ids: Sequence[int] = (),
    ) -> Tokenizer:
        """Builds from a ``tokenizer.json`` plus the dict of ``tokenizer_config.json`` (if any)."""
        backend = HFTokenizer.from_file(os.fspath(tokenizer_json))
        cfg = tokenizer_config or {}

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        bos = token_id("bos_token")
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:       # as transformers: BOS if the tokenizer's post-processor puts it (Llama 3)
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(backend, bos_token_id=bos, eos_token_id=token_id("eos_token"),
                   add_bos_token=add_bos, chat_template=template,
                   extra_eos_token_ids=generation_eos_ids)

    # -- API ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token text (``<|im_start|>``) becomes the special id unless
        ``parse_special`` is False; BOS is prepended only if asked and the model wants it."""
        backend = self._backend
        if not parse_special:
            if self._plain_text_backend is None:
                self._plain_text_backend = HFTokenizer.from_str(self._backend.to_str())
                self._plain_text_backend.encode_special_tokens = True
            backend = self._plain_text_backend
        try:
            if len(text) >= LONG_TEXT_CHARS:      # the batch call releases the GIL while it runs
                ids = backend.encode_batch([text], add_special_tokens=False)[0].ids
            else:
                ids = backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            _reject_lone_surrogates(text)
            raise
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_byte_table(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each id's bytes in a decode (see ``token_bytes``), or None when this tokenizer is not
        plain byte-level BPE; built and checked against ``decode`` on first use, then cached."""
        key = bool(skip_special_tokens)
        if key not in self._byte_tables:
            from ferrobatch.model.token_bytes import build_token_byte_table
            self._byte_tables[key] = build_token_byte_table(self._backend, key)
        return self._byte_tables[key]

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id."""
        return self._backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            tokenize: bool = False, chat_template: str | None = None,
                            **extra: Any) -> str | list[int]:
        """Renders a conversation to prompt text (its token ids with `tokenize=True`, special
        tokens parsed, none added); ValueError on bad messages or a missing template. Unlike
        transformers', text is the default; as there, `chat_template` replaces the model's."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this model has no chat template; send a plain completion prompt")
        if tokenize:
            return self.encode(self.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **extra))

        def text(token_id: int | None) -> str:
            return (self._backend.id_to_token(token_id) or "") if token_id is not None else ""

        return render_chat_template(
            source, messages, add_generation_prompt=add_generation_prompt,
            bos_token=text(self.bos_token_id), eos_token=text(self.eos_token_id), **extra,
        )
