"""A GGUF token-embedding table kept in its file format (Q4_K, Q6_K, Q8_0, F16, ...), each
looked-up row dequantized when a step asks for it; also a 16-bit checkpoint's table, whose
float32 values bfloat16 or float16 holds exactly, kept as those 16 bits (``from_dense``).

A step reads a few rows of the table (one per token), never all of it, so nothing needs the
float32 matrix: a Llama-3-8B's 128,256 x 4,096 table is 2.1 GB in float32 and 0.29 GB as Q4_K.
The rows a lookup returns are exactly the loader's float32 values (``dequant.dequantize_tensor``
works block by block, each row on its own). The CPU loader (``gguf_loader.load_gguf_blocks``)
makes one where a model's embedding is not also its only LM head weight.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ferrobatch.model.dequant import dequantize_tensor

_F32, _F16, _Q8_0, _BF16 = 0, 1, 8, 30


def _q8_0_rows(raw: np.ndarray) -> np.ndarray:
    """Q8_0 rows ``uint8 [n, bytes]`` -> float32 ``[n, values]``: each block's fp16 scale
    times its 32 int8 values, one float32 product each (as ``dequant`` computes them, without
    torch's per-op dispatch: a decode step looks up a few rows)."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)
    return (scale * blocks[..., 2:].view(np.int8)).reshape(raw.shape[0], -1)


def _f16_rows(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _bf16_rows(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# types whose rows numpy dequantizes directly (the same values; tested against dequant's)
_NUMPY_ROWS = {_Q8_0: _q8_0_rows, _F16: _f16_rows, _BF16: _bf16_rows}


def check_token_ids(ids: np.ndarray, vocab: int) -> None:
    """IndexError for an id of ``ids`` outside ``[0, vocab)`` (what ``nn.Embedding`` raises)."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise IndexError(f"token id out of range of the {vocab}-token embedding")


def keeps_table(name: str, type_id: int, ndim: int, config) -> bool:
    """True for the GGUF token embedding (Hugging Face name ``name``) a
    :class:`QuantizedEmbedding` serves as the loader would: stored in a type smaller than
    float32, not rescaled by the model (Granite's embedding multiplier), and, when tied, also
    read by the LM head's block kernel (a head that needs the float32 matrix gains nothing)."""
    from ferrobatch.model.block_weights import kept_as_blocks
    from ferrobatch.model.model_layout import folded_factor

    if name != "model.embed_tokens.weight" or ndim != 2 or type_id == _F32 \
            or folded_factor(name, config) != 1.0:
        return False
    return not config.tie_word_embeddings or kept_as_blocks(name, type_id, ndim, config)


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a table of GGUF rows ``raw`` (uint8
    ``[num_embeddings, bytes per row]``, GGUF type ``type_id`` / ``type_name``); float32 out."""

    def __init__(self, raw: torch.Tensor, type_id: int, type_name: str,
                 embedding_dim: int) -> None:
        super().__init__()
        if raw.dtype != torch.uint8 or raw.dim() != 2:
            raise ValueError(f"a GGUF embedding table is uint8 [rows, bytes], not "
                             f"{raw.dtype} {tuple(raw.shape)}")
        self.register_buffer("raw", raw.contiguous(), persistent=False)
        self.type_id, self.type_name = type_id, type_name
        self.num_embeddings, self.embedding_dim = raw.shape[0], embedding_dim
        self._table = self.raw.numpy()      # the same bytes, indexed without torch dispatch

    @classmethod
    def from_gguf(cls, tensor) -> QuantizedEmbedding:
        """The table of a GGUF tensor (``gguf_file.GGUFTensorInfo``, shape ``[vocab, hidden]``),
        its bytes copied out of the file's mapping."""
        rows, dim = tensor.shape
        raw = np.array(tensor.data, dtype=np.uint8).reshape(rows, -1)
        return cls(torch.from_numpy(raw), tensor.type_id, tensor.type_name, dim)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> QuantizedEmbedding | None:
        """A float32 table ``[vocab, hidden]`` whose every value bfloat16 (else float16) holds
        exactly, as those 16-bit rows (a bfloat16 checkpoint's embedding: half the bytes, the
        same rows); None where neither holds every value."""
        table = weight.detach().contiguous().numpy()
        if table.dtype != np.float32 or table.ndim != 2:
            return None
        rows, dim = table.shape
        bits = table.view(np.uint32)
        if not (bits & 0xFFFF).any():
            raw = (bits >> 16).astype(np.uint16)
            return cls(torch.from_numpy(raw.view(np.uint8).reshape(rows, 2 * dim)), _BF16,
                       "BF16", dim)
        halves = table.astype(np.float16)
        if np.array_equal(halves.astype(np.float32).view(np.uint32), bits):
            return cls(torch.from_numpy(halves.view(np.uint8).reshape(rows, 2 * dim)), _F16,
                       "F16", dim)
        return None

    @property
    def nbytes(self) -> int:
        """Bytes the table holds."""
        return self._table.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``[*ids.shape, embedding_dim]``: the table's rows ``ids`` (a fresh,
        writable array). IndexError for an id outside ``[0, num_embeddings)``."""
        ids = np.asarray(ids)
        check_token_ids(ids, self.num_embeddings)
        if ids.size == 0:
            return np.zeros((*ids.shape, self.embedding_dim), np.float32)
        flat = self._table[ids.reshape(-1)]
        fast = _NUMPY_ROWS.get(self.type_id)
        values = fast(flat) if fast is not None else \
            dequantize_tensor(flat, self.type_id, self.type_name).numpy()
        return values.reshape(*ids.shape, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.rows(input_ids.cpu().numpy())).to(input_ids.device)

    def dense_weight(self) -> torch.Tensor:
        """The whole table in float32 ``[num_embeddings, embedding_dim]`` (a fresh tensor), as
        ``PanelLinear.dense_weight`` gives a packed layer's."""
        return dequantize_tensor(self._table, self.type_id, self.type_name)

    def dequantized(self) -> nn.Embedding:
        """The whole table as a float32 ``nn.Embedding`` (for a path that needs the matrix:
        the tied LM head of a model whose linears are not packed)."""
        return nn.Embedding(self.num_embeddings, self.embedding_dim,
                            _weight=self.dense_weight(), _freeze=True)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name}"
