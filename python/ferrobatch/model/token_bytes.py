"""Token byte tables: the exact bytes each token id contributes to a byte-level BPE decode.

With a byte-level BPE tokenizer, decoding a sequence is concatenating each token's bytes and
reading the result as UTF-8 (invalid or incomplete sequences become U+FFFD). Knowing every
token's bytes lets the incremental detokenizer turn one new token into text with a table look-up
and an incremental UTF-8 decoder, instead of two calls into the tokenizer per token.

A table is only used when it is *proven* on the tokenizer it was built from: every id's bytes,
read as UTF-8, must equal the tokenizer's own decode of that id. Tokenizers whose decoder is not
plain byte-level (SentencePiece-style, say) get no table and keep the general detokenizer.
"""

from __future__ import annotations

from typing import Any

from tokenizers import decoders


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_CHAR_TO_BYTE = _unicode_to_byte()


def _token_bytes(token: str) -> bytes:
    """A vocabulary string's bytes; a token with a character outside the byte alphabet (an added
    token such as ``<|im_start|>\\n``) stands for its own UTF-8 text."""
    out = bytearray()
    for ch in token:
        b = _CHAR_TO_BYTE.get(ch)
        if b is None:
            return token.encode("utf-8")
        out.append(b)
    return bytes(out)


def build_token_byte_table(backend: Any, skip_special_tokens: bool) -> list[bytes] | None:
    """Every token id's bytes for ``backend`` (a ``tokenizers.Tokenizer``), or None when the
    tokenizer is not plain byte-level BPE or any id's bytes disagree with its own decode."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    table: list[bytes] = []
    for i in range(size):
        tok = added.get(i)
        if tok is not None and tok.special and skip_special_tokens:
            table.append(b"")
            continue
        text = tok.content if tok is not None else backend.id_to_token(i)
        if text is None:
            return None                      # a hole in the id space: not a table we can trust
        table.append(_token_bytes(text))
    decoded = backend.decode_batch([[i] for i in range(size)],
                                   skip_special_tokens=skip_special_tokens)
    for raw, text in zip(table, decoded):
        if raw.decode("utf-8", "replace") != text:
            return None
    return table
