"""The CLI: complete --help, and `python -m ferrobatch serve` draining on SIGINT then exiting 0."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import aiohttp
import pytest

from ferrobatch.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_help_is_complete(capsys):
    for cmd, flags in [("serve", ["--host", "--port", "--tcp-port", "--api-key", "--model",
                                  "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-gb",
                                  "--max-queued-requests", "--drain-timeout",
                                  "--attention-backend", "--log-level", "--log-stats-interval",
                                  "--disable-log-stats", "--access-log", "--chat-template", "--threads"]),
                       ("generate", ["--max-tokens", "--temperature", "--model", "--log-level"]),
                       ("chat", ["--max-tokens", "--system"])]:
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--help"])
        out = capsys.readouterr().out
        for flag in flags:
            assert flag in out, (cmd, flag)
        # a default of None says nothing (the help text says what happens instead)
        assert "(default: None)" not in out, cmd
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"            # loopback by default


async def test_serve_drains_on_sigint(smollm2_gguf_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), PYTHONUNBUFFERED="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ferrobatch", "serve", "--model", "smollm2", "--device", "cpu",
        "--port", "0", "--tcp-port", "0", "--kv-cache-gb", "0.05", "--max-num-seqs", "8",
        "--drain-timeout", "60", "--log-stats-interval", "0.5",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        cwd=ROOT)
    lines = []
    try:
        port = None
        while port is None:
            line = (await asyncio.wait_for(proc.stdout.readline(), 180)).decode()
            assert line, "server exited early:\n" + "".join(lines)
            lines.append(line)
            m = re.search(r"OpenAI HTTP : http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(m.group(1)) if m else None
        # the banner names the attention backend in use (the Rust kernel for a float32 CPU model)
        assert any("attention backend cpu" in line for line in lines), "".join(lines)
        # ... the KV cache (blocks, dtype, size: 0.05 GiB of float32 SmolLM2 blocks) ...
        assert any(re.search(r"KV cache: \d+ blocks of 16 tokens, float32, 0\.05 GiB", line)
                   for line in lines), "".join(lines)
        # ... its kernels, and where long prompt chunks go (AMX tiles where the CPU has AMX) ...
        from ferrobatch._scheduler import amx_available, linear_isa
        banner = [line for line in lines if line.startswith("  ")]    # not the log's lines
        attention = [line for line in banner
                     if f"attention: Rust {linear_isa()} kernels" in line]
        assert len(attention) == 1, "".join(lines)
        assert ("on AMX tiles" in attention[0]) == amx_available(), attention[0]
        # ... and the linear layers' kernels with the instruction set this CPU gives them
        linear = [line for line in banner
                  if f"linear layers: Rust {linear_isa()} kernels" in line]
        assert len(linear) == 1, "".join(lines)
        # ... and where their larger steps go (the GGUF blocks as AMX tiles or quantized panels)
        larger = "as AMX tiles for more" if amx_available() else "as quantized panels for more"
        assert larger in linear[0], linear[0]
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(f"http://127.0.0.1:{port}/v1/completions", json={
                "prompt": "Hello", "max_tokens": 12, "ignore_eos": True}))
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            resp = await req
            body = await resp.json()
        assert resp.status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 12
        rest = (await asyncio.wait_for(proc.stdout.read(), 60)).decode()
        assert await proc.wait() == 0, "".join(lines) + rest
        assert "draining" in rest and "stopped" in rest
        # the log: the start-up's INFO lines, timestamped on stderr, and the periodic engine
        # line, whose interval that saw the request finish says so
        log = "".join(lines) + rest
        assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO "
                         r"ferrobatch\.runtime\.model_runner: KV cache: ", log, re.M), log
        stats = re.findall(r"INFO ferrobatch\.stats: engine: (.*)", log)
        assert sum("finished 1 (length 1)" in line for line in stats) == 1, stats
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_generate_with_a_json_schema_prints_valid_json(smollm2_gguf_path):
    import json
    schema = json.dumps({"type": "object", "required": ["city", "country"],
                         "properties": {"city": {"type": "string", "maxLength": 30},
                                        "country": {"type": "string", "maxLength": 30}}})
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run(
        [sys.executable, "-m", "ferrobatch", "generate", "The capital of France, as JSON:",
         "--json-schema", schema, "--max-tokens", "60", "--device", "cpu",
         "--kv-cache-gb", "0.05"], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=300)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout.strip())
    assert set(obj) == {"city", "country"}


def test_guided_flags_conflict_is_a_clean_error(capsys):
    from ferrobatch.cli import main
    assert main(["generate", "x", "--json", "--regex", "[0-9]+"]) == 2
    err = capsys.readouterr().err
    assert "at most one of --json, --regex" in err and "Traceback" not in err
    assert main(["generate", "x", "--grammar", 'root ::= "a"', "--regex", "a"]) == 2
    assert "at most one of --regex, --grammar" in capsys.readouterr().err
    # a grammar file is read; one that is missing is a one-line error before any loading
    assert main(["generate", "x", "--grammar", "/nonexistent/g.gbnf"]) == 2
    assert "No such file" in capsys.readouterr().err
    for flag in ("--json-schema", "--json", "--regex", "--grammar", "--choice"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["chat", "--help"])
        assert flag in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["serve", "--port", "70000"], ["serve", "--port", "-5"],
                                  ["serve", "--tcp-port", "-2"]])
def test_ports_out_of_range_are_refused_before_loading(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "0..65535" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--tcp-port", "-1"]).tcp_port == -1


def test_any_failure_is_one_line_not_a_traceback(monkeypatch, capsys, tmp_path):
    """Whatever goes wrong (a missing schema file, a CUDA device this machine lacks, an error
    deep inside), the CLI prints one line and exits non-zero."""
    from ferrobatch import cli
    assert cli.main(["generate", "x", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err

    async def boom(args):
        raise RuntimeError("the allocator said no")
    monkeypatch.setattr(cli, "_generate", boom)
    assert cli.main(["generate", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: the allocator said no" in err
    assert "Traceback" not in err

    async def pipe(args):
        raise BrokenPipeError
    monkeypatch.setattr(cli, "_generate", pipe)
    assert cli.main(["generate", "x"]) == 0             # `... | head` is not an error


def test_a_cuda_device_this_machine_lacks_is_refused_before_loading():
    import torch

    from ferrobatch.config import EngineConfig
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="CUDA is not available"):
            EngineConfig(model="smollm2", device=device).resolved_device()
    assert EngineConfig(model="smollm2", device="auto").resolved_device() == "cpu"


def test_chat_keeps_going_when_a_turn_is_refused(monkeypatch, capsys):
    """A turn the engine refuses (the conversation outgrew the context) is reported and
    dropped from the history; the session goes on."""
    from ferrobatch import cli

    class Engine:
        default_sampling_fields: dict = {}

        def __init__(self, cfg):
            self.calls = []

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None

    seen = []

    async def stream_one(engine, params, prompt=None, messages=None, lora_request=None):
        seen.append([m["content"] for m in messages])
        if messages[-1]["content"] == "too long":
            raise ValueError("prompt exceeds the context window")
        return "ok"

    lines = iter(["hi", "too long", "again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    monkeypatch.setattr(cli, "_stream_one", stream_one)
    monkeypatch.setattr("ferrobatch.engine.async_engine.AsyncEngine", Engine)
    assert cli.main(["chat"]) == 0
    assert seen == [["hi"], ["hi", "ok", "too long"], ["hi", "ok", "again"]]
    assert "context window" in capsys.readouterr().err


def test_an_empty_api_key_is_refused_before_loading(capsys, monkeypatch):
    from ferrobatch import cli

    def no_engine(*a, **k):
        raise AssertionError("the model must not be loaded")
    monkeypatch.setattr("ferrobatch.engine.async_engine.AsyncEngine", no_engine)
    assert cli.main(["serve", "--api-key", ""]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_lora_flags_parse_and_imply_enable_lora(capsys):
    from ferrobatch.cli import _config
    from ferrobatch.serve.lora_api import parse_lora_module
    assert parse_lora_module("poet=/a/b") == ("poet", "/a/b")
    assert parse_lora_module('{"name": "poet", "path": "/a=b"}') == ("poet", "/a=b")
    for bad in ("poet", "=/a", "poet=", '{"name": "x"}', "{bad json"):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_module(bad)
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x", "b=/y",
                                      "--max-loras", "2"])
    assert args.lora_modules == [("a", "/x"), ("b", "/y")]
    config = _config(args)
    assert config.enable_lora and config.max_loras == 2
    assert not _config(build_parser().parse_args(["serve"])).enable_lora
    assert _config(build_parser().parse_args(["generate", "x", "--lora", "/x"])).enable_lora
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "nameonly"])
    assert "NAME=PATH" in capsys.readouterr().err


def test_processor_generation_config_and_store_flags_reach_the_engine(tmp_path, monkeypatch, capsys):
    """--logits-processors, --generation-config / --override-generation-config reach the
    engine's config; generate's sampling flags fall back to the model's defaults, then greedy."""
    from ferrobatch.cli import _config, _params
    (tmp_path / "procs.py").write_text("def factory(params):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = build_parser().parse_args([
        "serve", "--logits-processors", "procs:factory", "--generation-config", "vllm",
        "--override-generation-config", '{"temperature": 0.3}', "--enable-response-store",
        "--max-stored-responses", "8", "--return-tokens-as-token-ids"])
    config = _config(args)
    assert config.logits_processors == ("procs:factory",)
    assert config.generation_config == "vllm"
    assert config.override_generation_config == {"temperature": 0.3}
    assert args.enable_response_store and args.max_stored_responses == 8
    assert args.return_tokens_as_token_ids
    gen = build_parser().parse_args(["generate", "x"])
    assert _params(gen).temperature == 0.0                      # no model default: greedy
    assert _params(gen, {"temperature": 0.7, "top_k": 20}).temperature == 0.7
    own = build_parser().parse_args(["generate", "x", "--temperature", "0.2"])
    assert _params(own, {"temperature": 0.7}).temperature == 0.2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--override-generation-config", "[1]"])
    assert "JSON object" in capsys.readouterr().err
