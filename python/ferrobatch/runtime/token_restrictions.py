"""Token restrictions of a request (vLLM's `allowed_token_ids` and `bad_words`) as logit masks.

`allowed_token_ids` keeps only the listed tokens' logits. A bad word is banned as token
sequences: the word tokenized as written (leading blanks dropped) and with one leading space
(how it reads mid-sentence for byte-level BPE and SentencePiece vocabularies). A one-token
sequence is masked at every step; a longer one only where the sequence's output so far ends
with all of its tokens but the last, whose logit is then masked. So a bad word cannot be
completed through those spellings, while its first tokens stay available for other words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def bad_word_sequences(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell each of `words` (see the module docstring), deduplicated,
    in order."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def banned_next_tokens(history: Sequence[int],
                       sequences: Sequence[Sequence[int]]) -> list[int]:
    """The tokens that would complete one of `sequences` right after `history` (the tokens
    generated so far)."""
    banned = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (len(history) >= prefix and list(history[-prefix:]) == list(seq[:-1])):
            banned.append(seq[-1])
    return banned


def allowed_mask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """bool ``[vocab_size]``: True for the listed tokens."""
    mask = np.zeros(vocab_size, dtype=bool)
    mask[np.asarray(token_ids, dtype=np.int64)] = True
    return mask


def apply_token_restrictions(logits: torch.Tensor, rows: list[tuple[int, Any, list[int]]]
                             ) -> None:
    """Masks, in place, the restricted rows of ``logits [S, V]``. Each entry of `rows` is
    ``(row, extras, history)``: the row's `RequestExtras` (its `allowed_mask` and
    `bad_word_ids`) and the tokens its sequence has generated before that row."""
    banned_rows, banned_ids = [], []
    allowed_rows, allowed_masks = [], []
    for row, ext, history in rows:
        if ext.allowed_mask is not None:
            allowed_rows.append(row)
            allowed_masks.append(ext.allowed_mask)
        if ext.bad_word_ids:
            ids = banned_next_tokens(history, ext.bad_word_ids)
            banned_rows.extend([row] * len(ids))
            banned_ids.extend(ids)
    device = logits.device
    if allowed_rows:
        index = torch.tensor(allowed_rows, device=device)
        keep = torch.from_numpy(np.stack(allowed_masks)).to(device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    if banned_rows:
        logits[torch.tensor(banned_rows, device=device),
               torch.tensor(banned_ids, device=device)] = float("-inf")
