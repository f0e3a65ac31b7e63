"""vLLM's `--tokenizer` (`EngineConfig.tokenizer`): the tokenizer and chat template of a Hugging
Face directory (or a .gguf file) in place of the model's; a tokenizer the model cannot serve is
a clear error before anything runs. And `ferrobatch serve MODEL`, vLLM's positional model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_support import REAL_ENGINE_OPTIONS  # noqa: E402

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def _hf_tokenizer_dir(path: Path, loaded, template: str = TEMPLATE) -> Path:
    """SmolLM2's own tokenizer.json (the GGUF's vocabulary and merges) with another chat
    template and EOS, as a Hugging Face directory."""
    path.mkdir(exist_ok=True)
    loaded.tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>", "add_bos_token": False,
         "chat_template": template}))
    return path


def test_another_tokenizer_and_its_template_serve_the_model(loaded_smollm2, tmp_path):
    from ferrobatch.engine.llm import LLM
    from ferrobatch.sampling_params import SamplingParams
    directory = _hf_tokenizer_dir(tmp_path / "tok", loaded_smollm2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    messages = [{"role": "user", "content": "Hi there"}]
    with LLM("smollm2", loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as own:
        own_chat = own.chat(messages, params, use_tqdm=False)[0]
        own_text = own.generate("The capital of France is", params, use_tqdm=False)[0]
    with LLM("smollm2", loaded_model=loaded_smollm2, tokenizer=str(directory),
             **REAL_ENGINE_OPTIONS) as other:
        tok = other.get_tokenizer()
        assert tok.chat_template == TEMPLATE
        assert tok.eos_token_id == 0              # <|endoftext|>, where the GGUF says 2
        chat = other.chat(messages, params, use_tqdm=False)[0]
        assert chat.prompt_token_ids == tok.encode("<<Hi there>>")
        assert chat.prompt_token_ids != own_chat.prompt_token_ids
        text = other.generate("The capital of France is", params, use_tqdm=False)[0]
        assert text.outputs[0].token_ids == own_text.outputs[0].token_ids   # same vocabulary
    assert loaded_smollm2.tokenizer.chat_template != TEMPLATE     # the shared model's kept


def test_tokenizers_the_model_cannot_serve_are_refused(loaded_smollm2, tmp_path,
                                                       smollm2_gguf_path):
    from tokenizers import Tokenizer, models

    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.core import EngineCore
    from ferrobatch.model.loader import load_tokenizer

    def build(tokenizer):
        return EngineCore.build(EngineConfig(tokenizer=tokenizer, num_blocks=32),
                                loaded_smollm2)

    with pytest.raises(FileNotFoundError, match="not found"):
        build(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        build(str(tmp_path / "empty"))
    (tmp_path / "vocab.txt").write_text("a")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        build(str(tmp_path / "vocab.txt"))
    big = tmp_path / "big"
    big.mkdir()
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(50_000)}, unk_token="t0")).save(
        str(big / "tokenizer.json"))
    with pytest.raises(ValueError, match="50000 tokens, more than the model's 49152"):
        build(str(big))
    gguf = load_tokenizer(smollm2_gguf_path)          # a .gguf file's tokenizer
    assert gguf.encode("Hello world") == loaded_smollm2.tokenizer.encode("Hello world")


def test_serve_takes_the_model_as_vllm_does(capsys):
    from ferrobatch.cli import _config, parse_args
    args = parse_args(["serve", "Qwen/Qwen2.5-0.5B-Instruct", "--enable-auto-tool-choice",
                       "--trust-remote-code", "--tokenizer", "/tok"])
    config = _config(args)
    assert config.model == "Qwen/Qwen2.5-0.5B-Instruct" and config.tokenizer == "/tok"
    assert _config(parse_args(["serve"])).model == "smollm2"
    assert _config(parse_args(["serve", "--model", "a.gguf"])).model == "a.gguf"
    with pytest.raises(SystemExit):
        parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    assert "given twice" in capsys.readouterr().err
    # vLLM's flags for how ferrobatch runs anyway; the one that turns something off does
    vllm_like = parse_args(["serve", "m", "--enable-prefix-caching", "--enable-chunked-prefill",
                            "--disable-log-requests", "-tp", "1"])
    assert _config(vllm_like).enable_prefix_caching
    assert not _config(parse_args(["serve", "--no-enable-prefix-caching"])).enable_prefix_caching
    with pytest.raises(SystemExit):
        parse_args(["serve", "--tensor-parallel-size", "2"])
    assert "one device" in capsys.readouterr().err
