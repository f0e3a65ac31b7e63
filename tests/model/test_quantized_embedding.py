"""The token embedding of a GGUF loaded as the CPU engine loads it (``gguf_blocks=True``) stays in
the file's format (``QuantizedEmbedding``): each looked-up row is dequantized when a step asks.

Oracle: the float32 loader's table (``load_model`` without blocks) row for row, bit for bit,
and transformers' greedy tokens on the same weights; the runner's fused CPU step and the torch
path both look rows up through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_tiny import write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model
from test_gguf_block_loading import granite_keys
from test_granite import TINY_GRANITE
from test_kquants import TINY_256, q4_k_m

from ferrobatch.model.loader import load_model
from ferrobatch.model.quantized_embedding import QuantizedEmbedding
from ferrobatch.runtime.model_runner import ModelRunner

# GGUF type -> bytes per weight of its rows
TYPES = {"Q4_0": 18 / 32, "Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256,
         "Q8_0": 34 / 32, "Q2_K": 84 / 256, "IQ4_XS": 136 / 256, "F16": 2.0}
PROMPTS = [list(range(3, 40)), [5, 9, 11], [127, 0, 64]]


@pytest.fixture(scope="module", params=sorted(TYPES))
def untied(request, tmp_path_factory):
    """(path, transformers reference, type name): the tiny Qwen2 in llama.cpp's Q4_K_M mix,
    its (untied) embedding in the type."""
    reference = random_hf_model(TINY_256, seed=43, std=0.1)
    path = tmp_path_factory.mktemp("embd") / f"{request.param}.gguf"
    write_tiny_gguf(path, reference, TINY_256, "qwen2", linear_types=q4_k_m,
                    embedding_type=request.param)
    return str(path), reference, request.param


def test_the_table_stays_in_its_format_and_looks_up_the_loader_s_rows(untied):
    path, _, type_name = untied
    dense = load_model(path).model.embed_tokens.weight
    table = load_model(path, gguf_blocks=True).model.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and table.type_name == type_name
    vocab, hidden = dense.shape
    assert table.nbytes == vocab * hidden * TYPES[type_name]       # not 4 bytes a weight
    ids = torch.tensor([[0, 5, 5, vocab - 1], [3, 2, 1, 0]])
    assert torch.equal(table(ids), dense[ids])
    rows = table.rows(np.array([7, 7, 100]))
    assert rows.flags.writeable and rows.dtype == np.float32
    assert torch.equal(torch.from_numpy(rows), dense[[7, 7, 100]])
    assert table(torch.zeros(0, dtype=torch.long)).shape == (0, hidden)
    assert torch.equal(table.dequantized().weight, dense)
    for bad in (vocab, -1):
        with pytest.raises(IndexError, match=f"out of range of the {vocab}-token embedding"):
            table(torch.tensor([3, bad]))


def test_a_runner_serves_it_and_matches_transformers(untied):
    path, reference, _ = untied
    loaded = load_model(path, gguf_blocks=True)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert isinstance(loaded.model.embed_tokens, QuantizedEmbedding)
    assert runner.fused_layers is not None      # the fused step looks its rows up
    steps = runner.fused_layers.steps
    assert_greedy_matches(loaded, reference, PROMPTS, 6, runner=runner)
    assert runner.fused_layers.steps > steps


def test_the_torch_path_looks_it_up_too(untied):
    path, reference, _ = untied
    loaded = load_model(path, gguf_blocks=True)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4, pack_weights=False)
    assert isinstance(loaded.model.embed_tokens, QuantizedEmbedding)     # untied: kept
    assert runner.fused_layers is None
    assert_greedy_matches(loaded, reference, PROMPTS, 6, runner=runner)


TINY_TIED = {**TINY_256, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
             "tie_word_embeddings": True}


@pytest.mark.parametrize("embedding_type,kept", [("Q4_K", True), ("Q8_0", True),
                                                 ("F16", False)])
def test_a_tied_table_is_kept_where_the_lm_head_reads_its_blocks(tmp_path, embedding_type,
                                                                 kept):
    """A tied embedding in a block type is the LM head's blocks and a QuantizedEmbedding; an
    F16 one, which the head would need in float32 anyway, is dequantized. A runner that does
    not pack gives the tied head (and so the embedding) its float32 matrix."""
    reference = random_hf_model(TINY_TIED, seed=44, std=0.1)
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, reference, TINY_TIED, "llama", q4_k_linears=True,
                    embedding_type=embedding_type)
    dense = load_model(str(path)).model.embed_tokens.weight
    loaded = load_model(str(path), gguf_blocks=True)
    assert isinstance(loaded.model.embed_tokens, QuantizedEmbedding) == kept
    assert ("lm_head" in loaded.model.gguf_block_weights) == kept
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert_greedy_matches(loaded, reference, PROMPTS, 6, runner=runner)

    unpacked = load_model(str(path), gguf_blocks=True)
    ModelRunner(unpacked, num_blocks=64, block_size=4, pack_weights=False)
    table = unpacked.model.embed_tokens
    assert type(table) is torch.nn.Embedding and torch.equal(table.weight, dense)
    assert torch.equal(unpacked.model.lm_head_weight, dense)


def test_a_tied_head_in_blocks_has_no_float32_matrix_before_a_runner(tmp_path):
    reference = random_hf_model(TINY_TIED, seed=45, std=0.1)
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, reference, TINY_TIED, "llama", embedding_type="Q8_0")
    loaded = load_model(str(path), gguf_blocks=True)
    with pytest.raises(RuntimeError, match="tied LM head's matrix is kept in GGUF blocks"):
        _ = loaded.model.lm_head_weight


def test_granite_s_scaled_table_is_dequantized(tmp_path):
    """Granite multiplies its embedding by a factor the loader folds into the table: the
    file's rows are not the model's, so the table is float32."""
    cfg = {**TINY_GRANITE, "tie_word_embeddings": False}
    reference = random_hf_model(cfg, seed=46, std=0.1)
    path = tmp_path / "granite.gguf"
    write_tiny_gguf(path, reference, cfg, "granite", q8_0_linears=True, metadata=granite_keys,
                    embedding_type="Q8_0")
    loaded = load_model(str(path), gguf_blocks=True)
    assert type(loaded.model.embed_tokens) is torch.nn.Embedding
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert_greedy_matches(loaded, reference, PROMPTS, 6, runner=runner)


def test_the_engine_reports_the_table(untied, caplog):
    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.core import EngineCore

    path, _, type_name = untied
    with caplog.at_level("INFO", logger="ferrobatch"):
        core = EngineCore.build(EngineConfig(model=path, device="cpu", num_blocks=16))
    assert isinstance(core.runner.model.embed_tokens, QuantizedEmbedding)
    assert f"token embedding: {type_name} rows" in caplog.text
