"""GGUF's SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``: Llama 1 / 2, Mistral
7B, Phi-3, TinyLlama, ...) as a ``tokenizers`` BPE that tokenizes as llama.cpp does.

llama.cpp's SentencePiece tokenizer escapes spaces as ``▁`` (with one in front of the text and
after every special token where ``tokenizer.ggml.add_space_prefix``), then merges, again and
again, the adjacent pair of symbols whose concatenation is the vocabulary piece of highest score
(the leftmost on a tie), and spells out what no piece covers as its UTF-8 bytes' ``<0xNN>``
tokens. A BPE whose merges are ranked by the merged piece's score makes the same choices; its
normalizer does the escaping per text segment between special tokens, and its decoder undoes
both (``tests/model/test_spm_tokenizer.py`` checks it against the sentencepiece library).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

SPACE = "\u2581"
# llama.cpp's token types (llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _merges(pieces: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two pieces of the vocabulary, best merged score
    first (ties: the merged piece's id, then the left part's length), as BPE merge ranks."""
    ids = {p: i for i, p in enumerate(pieces) if types[i] in (_NORMAL, _USER_DEFINED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_backend(meta: Any) -> HFTokenizer:
    """The ``tokenizers.Tokenizer`` of ``GGUFTokenizerMetadata`` whose model is ``"llama"``
    (scores and the space-prefix flag in ``meta.extra``)."""
    pieces = list(meta.tokens)
    types = list(meta.token_types or [_NORMAL] * len(pieces))
    scores = list(meta.extra.get("scores") or [0.0] * len(pieces))
    if not (len(types) == len(scores) == len(pieces)):
        raise ValueError(f"GGUF SentencePiece vocabulary: {len(pieces)} tokens but "
                         f"{len(types)} types and {len(scores)} scores")
    unk_id = meta.extra.get("unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    model = models.BPE(vocab, _merges(pieces, scores, types), byte_fallback=True,
                       fuse_unk=True, unk_token=None if unk_id is None else pieces[unk_id])
    backend = HFTokenizer(model)
    escape = [normalizers.Replace(" ", SPACE)]
    if meta.extra.get("add_space_prefix", True):
        escape.insert(0, normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(escape)
    unescape = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.extra.get("add_space_prefix", True):
        unescape.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(unescape)
    backend.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _CONTROL])
    backend.add_tokens([AddedToken(pieces[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])
    return backend
