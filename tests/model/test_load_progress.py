"""Loading progress (model/progress.py): silent for small models, a byte-counting bar for big
ones (here: the threshold lowered to 0 on the shipped GGUF), off with FERROBATCH_NO_PROGRESS."""

from __future__ import annotations

import ferrobatch.model.progress as progress
from ferrobatch.model.gguf_loader import load_gguf
from ferrobatch.model.progress import PROGRESS_MIN_BYTES, load_progress


def test_small_loads_print_nothing(capsys):
    bar = load_progress(PROGRESS_MIN_BYTES - 1, "x")
    bar.update(10)
    bar.close()
    assert capsys.readouterr().err == ""


def test_a_big_load_shows_its_bytes(smollm2_gguf_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.delenv("FERROBATCH_NO_PROGRESS", raising=False)
    config, state, _ = load_gguf(smollm2_gguf_path)
    err = capsys.readouterr().err
    assert "Dequantizing GGUF weights: 100%" in err, err
    assert state and config.num_layers == 30
    monkeypatch.setenv("FERROBATCH_NO_PROGRESS", "1")
    load_progress(1 << 40, "y").close()
    assert capsys.readouterr().err == ""


def test_a_big_model_shows_its_blocks_read_and_its_weights_packed(smollm2_gguf_path, capsys,
                                                                  monkeypatch):
    """The engine's CPU load (GGUF blocks, then the runner packing them) shows both steps."""
    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.model_runner import ModelRunner

    monkeypatch.setattr(progress, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.delenv("FERROBATCH_NO_PROGRESS", raising=False)
    loaded = load_model(smollm2_gguf_path, gguf_blocks=True)
    assert "Reading GGUF weights: 100%" in capsys.readouterr().err
    ModelRunner(loaded, num_blocks=8, block_size=16)
    err = capsys.readouterr().err
    assert "Packing weights for the CPU kernels: 100%" in err, err
