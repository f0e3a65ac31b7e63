"""The model's sampling defaults: read from a Hugging Face generation_config.json and from a
GGUF file's general.sampling.* keys, the settings (auto / vllm / a directory), overrides, values
that cannot be used, and how a door's own defaults combine with them."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_support import REAL_ENGINE_OPTIONS  # noqa: E402

from ferrobatch.config import EngineConfig  # noqa: E402
from ferrobatch.engine.llm import LLM  # noqa: E402
from ferrobatch.model import generation_defaults as gd  # noqa: E402
from ferrobatch.sampling_params import SamplingParams  # noqa: E402

QWEN_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.7,
             "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 64,
             "transformers_version": "4.45.0"}


def _hf_dir(tmp_path, config):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "generation_config.json").write_text(json.dumps(config))
    return str(d)


def _gguf(tmp_path, **sampling):
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in sampling.items():
        if isinstance(value, int):
            writer.add_int32(f"general.sampling.{key}", value)
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    writer.add_float32("general.sampling.penalty_repeat", 1.3)     # not read
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_hugging_face_generation_config_gives_its_sampling_fields(tmp_path):
    d = _hf_dir(tmp_path, QWEN_LIKE)
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
            "max_tokens": 64}
    assert gd.resolve(d) == want
    assert gd.resolve(d, "vllm") == {}
    assert gd.resolve("random:smollm2-135m", str(tmp_path / "model")) == want    # a directory
    assert gd.resolve("x", str(tmp_path / "model" / "generation_config.json")) == want
    assert gd.resolve(d, "auto", {"temperature": 0.1, "min_p": 0.05}) == {
        **want, "temperature": 0.1, "min_p": 0.05}
    assert gd.resolve(_hf_dir(tmp_path, {"eos_token_id": 2})) == {}       # SmolLM2's kind


def test_gguf_sampling_keys(tmp_path):
    path = _gguf(tmp_path, temp=0.6, top_k=20, top_p=0.95, min_p=0.0)
    got = gd.resolve(path)
    assert got.keys() == {"temperature", "top_k", "top_p", "min_p"}
    assert got["top_k"] == 20 and got["min_p"] == 0.0
    assert got["temperature"] == pytest.approx(0.6) and got["top_p"] == pytest.approx(0.95)
    assert all(type(v) in (int, float) for v in got.values())        # no numpy scalars


def test_the_embedded_model_has_no_defaults():
    from ferrobatch.model.loader import smollm2_gguf_path
    assert gd.resolve(smollm2_gguf_path()) == {}


def test_unusable_values_in_the_model_files_are_skipped(tmp_path, caplog):
    d = _hf_dir(tmp_path, {"temperature": 0.6, "top_p": 0.0, "max_new_tokens": 0, "top_k": -1})
    with caplog.at_level(logging.WARNING, logger="ferrobatch.model"):
        assert gd.resolve(d) == {"temperature": 0.6, "top_k": 0}
    assert "top_p=0.0" in caplog.text and "max_tokens=0" in caplog.text


def test_settings_and_overrides_are_checked_when_configured(tmp_path):
    EngineConfig(generation_config="vllm", override_generation_config={"temperature": 0.2})
    EngineConfig(generation_config=_hf_dir(tmp_path, QWEN_LIKE))
    for kw, message in [
            ({"generation_config": "/no/such/dir"}, "neither 'auto', 'vllm' nor an existing"),
            ({"generation_config": 3}, "must be 'auto', 'vllm' or a directory"),
            ({"override_generation_config": {"temperature": -1}}, "temperature must be"),
            ({"override_generation_config": {"stop": ["x"]}}, "unknown field.*stop"),
            ({"override_generation_config": [1]}, "must be a map")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**kw)


def test_a_doors_defaults_over_the_models():
    model = {"temperature": 0.7, "max_tokens": 64}
    # the door's max_tokens stays (the model's caps "fill the context" in the engine instead)
    assert gd.under_door_defaults(model, {"max_tokens": 16}) == {"temperature": 0.7,
                                                                   "max_tokens": 16}
    assert gd.under_door_defaults(model, {"max_tokens": None}) == {"temperature": 0.7,
                                                                     "max_tokens": None}
    assert gd.under_door_defaults(model, {"temperature": 0.1}) == {"temperature": 0.1}


def test_llm_generate_and_chat_take_them(loaded_smollm2, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5,
                                                                 "temperature": 0.0}))
    llm = LLM("smollm2", loaded_model=loaded_smollm2, generation_config=str(tmp_path),
              **REAL_ENGINE_OPTIONS)
    try:
        assert llm.get_default_sampling_params().temperature == 0.0
        # generate keeps SamplingParams' 16; chat fills the context up to the model's 5
        assert len(llm.generate("The capital of France is")[0].outputs[0].token_ids) == 16
        chat = llm.chat([{"role": "user", "content": "Name three colours."}])
        assert len(chat[0].outputs[0].token_ids) == 5
        greedy = llm.generate("The capital of France is",
                              SamplingParams(max_tokens=16, temperature=0.0))
        assert llm.generate("The capital of France is")[0].outputs[0].text == \
            greedy[0].outputs[0].text
        # a prompt 3 tokens short of the 2048-token context is not refused for the model's
        # cap of 5: filling the context gives the 3 that fit
        ids = llm.get_tokenizer().encode("word " * 2100)[:2045]
        out = llm.generate({"prompt_token_ids": ids},
                           SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.close()
