"""Command line: `ferrobatch serve | generate | chat` (also `python -m ferrobatch ...`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any

from ferrobatch.config import KV_CACHE_DTYPES, EngineConfig
from ferrobatch.engine.stats_logger import DEFAULT_INTERVAL_S
from ferrobatch.log_config import LOG_LEVELS, configure_logging
from ferrobatch.sampling_params import SamplingParams


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it is None or False, or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False) or "default" in text:
            return text
        return super()._get_help_string(action)


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2",
                   help="'smollm2' (embedded), a .gguf file, a Hugging Face model directory "
                   "or a Hub id ('org/name': its cached snapshot, else downloaded)")
    g.add_argument("--tokenizer", default=None, metavar="PATH_OR_HUB_ID",
                   help="take the tokenizer (and chat template) from here instead of the "
                   "model: a Hugging Face directory or Hub id, or a .gguf file (vLLM's; e.g. "
                   "a GGUF model with its base model's tokenizer)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's commands: ferrobatch runs no code from a model "
                   "repository, whatever this says")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default=None,
                   help="auto | float32 | float16 | bfloat16 (default auto: per device)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences in one step's batch (default 128 on CPU, 256 on GPU)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (prefill chunks + decodes); default 512 on "
                   "CPU, 8192 on GPU")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context window (prompt + output); default min(model, 8192)")
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache size in GiB (default 1 on CPU; on GPU a memory fraction)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what the KV cache stores: auto = the model's dtype; float16 / fp8 "
                   "(FP8 E4M3, vLLM's fp8; fp8_e4m3 the same) / int8 (a scale per token and KV "
                   "head, llama.cpp's q8_0) (CPU, float32 model) hold two / four / 3.8 times the "
                   "tokens per GiB and cut what decode attention reads alike, but greedy output "
                   "is no longer token-identical to a float32 reference (fp8 moves it most)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: the share of the memory left after the weights, a warm-up "
                   "step's peak and the graphs' reserve that the KV cache takes "
                   "(--kv-cache-gb sets its size instead)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of prompt prefixes computed before")
    v = p.add_argument_group("accepted for vLLM's command lines (what they ask is how "
                             "ferrobatch runs anyway)")
    v.add_argument("--enable-prefix-caching", action="store_true",
                   help="prefix caching is on unless --no-prefix-caching")
    v.add_argument("--enable-chunked-prefill", action="store_true",
                   help="long prompts are always prefilled in chunks beside the decodes")
    v.add_argument("--disable-log-requests", action="store_true",
                   help="no request is logged unless --access-log")
    v.add_argument("-tp", "--tensor-parallel-size", type=_one_device, default=1, metavar="1",
                   help="ferrobatch runs a model on one device: only 1")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: arrival order; priority: a request's priority first (lower "
                   "runs first), then arrival")
    g.add_argument("--admission-batch", type=int, default=1, metavar="K",
                   help="while sequences run, waiting requests join only when K of them (all "
                   "that wait, if fewer) find free slots, so one refill step's prefill serves "
                   "several (1 = join as soon as a slot frees)")
    g.add_argument("--admission-max-wait-steps", type=int, default=8, metavar="S",
                   help="with --admission-batch: admit anyway after S held steps in a row")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                   help="a Jinja chat template (a file, or the template's text) replacing the "
                   "model's own, e.g. for a base model that has none")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="waiting requests beyond which new ones get 429 / an error 429")
    g.add_argument("--attention-backend", choices=["auto", "torch", "cpu", "cuda"], default="auto",
                   help="auto: CUDA kernels on a GPU, the Rust decode and prefill kernels on CPU "
                   "(float32), else the torch reference")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (no CUDA graphs)")
    g.add_argument("--piecewise-max-tokens", type=int, default=None, metavar="T",
                   help="CUDA: prefill and mixed steps of up to T tokens replay the model "
                   "between its attention calls as CUDA graphs (0 = off; default: "
                   "--max-num-batched-tokens up to 8192)")
    g.add_argument("--no-flash-prefill", action="store_true",
                   help="CUDA, bf16/fp16: prefill attention on ferrobatch's own kernel instead "
                   "of torch's FlashAttention-2 (which is used only after a start-up check "
                   "against that kernel)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="speculative decoding by prompt lookup: up to K tokens drafted from "
                   "the sequence's own earlier text and checked in one step (0 = off; default "
                   "3 on CPU, 0 on GPU)")
    g.add_argument("--speculative-max-running", type=int, default=None, metavar="N",
                   help="draft only while at most N sequences run (0 = at any load; default "
                   "0 on CPU, 8 on GPU)")
    g.add_argument("--speculative-max-step-tokens", type=int, default=None, metavar="T",
                   help="drafts fill a step only up to T tokens in all (0 = the step budget; "
                   "default 8 on CPU, 0 on GPU)")
    g.add_argument("--speculative-fixed-length", action="store_true",
                   help="always draft K tokens (default: after drafts the model cut short at "
                   "A accepted tokens, a sequence drafts at most A + 1 next)")
    g.add_argument("--speculative-ngram", type=int, nargs=2, default=(2, 4),
                   metavar=("MIN", "MAX"), help="n-gram lengths prompt lookup matches")
    g.add_argument("--threads", type=int, default=None, metavar="N", dest="cpu_threads",
                   help="CPU: threads the kernels run on (default: torch's count, i.e. the "
                   "cores or $OMP_NUM_THREADS)")
    g.add_argument("--no-gguf-blocks", action="store_true",
                   help="CPU: never read a GGUF model's blocks (Q4_1 form / Q8_0 / Q8G16), nor "
                   "their AMX tiles or quantized panels: the model is dequantized to float32 "
                   "at load and runs on float32 panels (more memory, slower steps)")
    g.add_argument("--no-amx", action="store_true",
                   help="CPU with AMX: steps of 5+ rows read the float32 panels (or the blocks, "
                   "up to 8 rows) instead of the GGUF blocks as AMX tiles (saves the tiles' "
                   "memory, slower steps), and long prompt chunks' attention stays on AVX-512 "
                   "(FERROBATCH_CPU_ISA=avx512 does the same)")
    g.add_argument("--no-fused-decode", action="store_true",
                   help="CPU: run steps layer by layer from Python instead of all layers "
                   "in one Rust call (same results, slower; for comparison)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for fields a request leaves unset: 'auto' = the "
                   "model's generation_config.json (GGUF: general.sampling.*), 'vllm' = the "
                   "built-in ones, or a directory holding a generation_config.json")
    g.add_argument("--override-generation-config", type=_json_object, default=None,
                   metavar="JSON", help="sampling defaults set over those, e.g. "
                   "'{\"temperature\": 0.5}' (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, max_tokens)")
    g.add_argument("--logits-processors", nargs="+", default=(), metavar="MODULE:NAME",
                   help="engine-wide logits processor factories, by import path: each is "
                   "called with a request's SamplingParams (its extra_args: the HTTP body's "
                   "vllm_xargs) and returns a processor fn(output_token_ids, logits) for it, "
                   "or None")
    lo = p.add_argument_group("LoRA adapters (Hugging Face PEFT directories)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="requests may run with LoRA adapters (implied by --lora-modules, --lora "
                    "and --allow-runtime-lora)")
    lo.add_argument("--max-loras", type=int, default=4, metavar="N",
                    help="adapters loaded at once; a request whose adapter finds every slot "
                    "held by running requests waits for one")
    lo.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                    help="adapters of a higher rank are refused")
    if p.prog.split()[-1] in ("serve", "batch"):
        lo.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        type=_lora_module,
                        help="serve these adapters, each as a model name of its own (also "
                        "vLLM's JSON form '{\"name\": ..., \"path\": ...}')")
    else:
        lo.add_argument("--lora", default=None, metavar="PATH",
                        help="run with this adapter")


def _config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, device=a.device, dtype=a.dtype, seed=getattr(a, "engine_seed", None),
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
        kv_cache_gb=a.kv_cache_gb, kv_cache_dtype=a.kv_cache_dtype,
        gpu_memory_utilization=a.gpu_memory_utilization,
        block_size=a.block_size, enable_prefix_caching=not a.no_prefix_caching,
        scheduling_policy=a.scheduling_policy, max_queued_requests=a.max_queued_requests,
        admission_batch=a.admission_batch, admission_max_wait_steps=a.admission_max_wait_steps,
        attn_backend=a.attention_backend, cuda_graphs=not a.enforce_eager,
        piecewise_max_tokens=a.piecewise_max_tokens, flash_prefill=not a.no_flash_prefill,
        gguf_blocks=not a.no_gguf_blocks, amx_tiles=not a.no_amx,
        fused_decode=not a.no_fused_decode,
        num_speculative_tokens=a.num_speculative_tokens,
        speculative_max_running=a.speculative_max_running,
        speculative_max_step_tokens=a.speculative_max_step_tokens,
        speculative_adaptive=not a.speculative_fixed_length,
        speculative_ngram_min=a.speculative_ngram[0], speculative_ngram_max=a.speculative_ngram[1],
        chat_template=_template_text(a.chat_template), tokenizer=a.tokenizer,
        cpu_threads=a.cpu_threads,
        enable_lora=a.enable_lora or bool(getattr(a, "lora_modules", None))
        or getattr(a, "allow_runtime_lora", False) or getattr(a, "lora", None) is not None,
        max_loras=a.max_loras, max_lora_rank=a.max_lora_rank,
        logits_processors=tuple(a.logits_processors), generation_config=a.generation_config,
        override_generation_config=a.override_generation_config)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    from ferrobatch.serve.lora_api import parse_lora_module
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_request(a: argparse.Namespace) -> Any:
    """`generate` / `chat`'s `--lora PATH` as a LoRARequest (None without it)."""
    if getattr(a, "lora", None) is None:
        return None
    from ferrobatch.lora_request import LoRARequest
    return LoRARequest(os.path.basename(os.path.normpath(a.lora)) or "lora", 1, a.lora)


def _text_or_file(value: str, is_text: bool) -> str:
    """An option that takes a text or a file holding it: `value` itself when `is_text`, else
    the file's content (FileNotFoundError: a one-line error)."""
    if is_text:
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


def _template_text(value: str | None) -> str | None:
    """--chat-template's value: the template's text, read from a file unless it is Jinja."""
    if value is None:
        return None
    return _text_or_file(value, "{{" in value or "{%" in value)


def _one_device(text: str) -> int:
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(f"{text!r}: ferrobatch runs a model on one device "
                                         "(only 1)")
    return 1


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {port}")
    return port


def _port_or_off(text: str) -> int:
    return -1 if int(text) == -1 else _port(text)


def _server_url(text: str) -> str:
    """A server's root URL (a trailing "/v1", as OpenAI clients take it, is dropped)."""
    url = text.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL")
    return url.removesuffix("/v1")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _origins(text: str) -> frozenset[str]:
    from ferrobatch.serve.cors import parse_origins
    try:
        return parse_origins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _log_level_arg(g: Any, default: str) -> None:
    g.add_argument("--log-level", choices=LOG_LEVELS, default=default,
                   help="the least severe log records shown (on stderr, timestamped)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrobatch", description="Continuous-batching LLM "
                                     "serving engine: OpenAI HTTP + WebSocket, msgpack/TCP.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI + WebSocket) and TCP",
                       formatter_class=_HelpFormatter)
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model takes it (vLLM's `vllm serve MODEL`)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's commands: tool_choice 'auto' is on wherever a "
                   "tool-call parser applies (--tool-call-parser, or the chat template's)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=_port, default=8000, help="HTTP + WebSocket port")
    s.add_argument("--tcp-port", type=_port_or_off, default=8001,
                   help="msgpack/TCP port (-1: off)")
    s.add_argument("--api-key", default=os.environ.get("FERROBATCH_API_KEY"),
                   help="require this key (Bearer token / TCP hello) on every route but /health; "
                        "default $FERROBATCH_API_KEY")
    s.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="serve a chat reply's <think>...</think> part as reasoning_content "
                   "(deepseek_r1: the reply starts inside it; qwen3: when it opens with <think>)")
    s.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="how the model writes its own tool calls, for tool_choice 'auto' "
                   "(default: what its chat template asks for: Hermes <tool_call> blocks, "
                   "Llama 3 JSON calls, Mistral's [TOOL_CALLS] or a Python list of calls, "
                   "as Llama 3.2's lightweight models and Llama 4 write them)")
    s.add_argument("--enable-response-store", action="store_true",
                   help="the Responses API keeps finished responses in memory: "
                   "previous_response_id continues one, GET /v1/responses/{id} returns it")
    s.add_argument("--max-stored-responses", type=int, default=1024, metavar="N",
                   help="with --enable-response-store: the most kept at once (the least "
                   "recently used go first)")
    s.add_argument("--enable-batch-api", action="store_true",
                   help="serve OpenAI's Files and Batches APIs (/v1/files, /v1/batches): "
                   "uploaded JSONL files of requests run as batch jobs through this server's "
                   "routes; files are kept in a temporary directory until the server stops")
    s.add_argument("--batch-max-file-mb", type=_positive_int, default=200, metavar="MB",
                   help="with --enable-batch-api: the largest file an upload may be")
    s.add_argument("--batch-concurrency", type=_positive_int, default=64, metavar="N",
                   help="with --enable-batch-api: the requests of one batch in flight at once")
    s.add_argument("--batch-priority", type=int, default=1, metavar="P",
                   help="with --enable-batch-api: the priority of a batch's requests that set "
                   "none (with --scheduling-policy priority, lower runs first: live requests "
                   "are 0)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs show each token as 'token_id:<id>' (a request's "
                   "return_tokens_as_token_ids overrides it)")
    s.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="the model id(s) clients use; the first is the one reported "
                   "(default: the model's name)")
    s.add_argument("--seed", type=int, default=None, dest="engine_seed",
                   help="seeds the sampling of requests that carry no seed of their own "
                   "(default: a random start)")
    s.add_argument("--allowed-origins", default=None, type=_origins, metavar="ORIGINS",
                   help="let web pages of these origins call the HTTP API from a browser "
                        "(CORS): '*' or a comma-separated list like "
                        "'http://localhost:3000,https://app.example'; default: CORS off")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish on SIGINT/SIGTERM")
    s.add_argument("--allow-runtime-lora", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lets "
                   "any API client make the server read a directory)")
    s.add_argument("--allow-weight-updates", action="store_true",
                   help="serve POST /update_weights_from_disk {\"model_path\": ...}: the "
                   "model's weights replaced in place from a checkpoint of its shape (lets any "
                   "API client make the server read a path and change every later reply)")
    lg = s.add_argument_group("logging")
    _log_level_arg(lg, "info")
    lg.add_argument("--log-stats-interval", type=_seconds, default=DEFAULT_INTERVAL_S,
                    metavar="S", help="log a line of engine activity (prompt and generation "
                    "tok/s, running and waiting requests, KV cache use, prefix cache hits) "
                    "every S seconds while there is any (0 = never)")
    lg.add_argument("--disable-log-stats", action="store_true",
                    help="no periodic engine line (vLLM's flag; --log-stats-interval 0)")
    lg.add_argument("--vllm-metric-names", action="store_true",
                    help="/metrics names its metrics vllm:... (vllm:num_requests_running, "
                    "vllm:time_to_first_token_seconds, ...) as vLLM does, so that dashboards "
                    "made for vLLM read them (default: ferrobatch_...)")
    lg.add_argument("--access-log", action="store_true",
                    help="one INFO line per HTTP request: client, request line, status, bytes, "
                    "seconds (WebSocket and TCP sessions are not logged)")
    _engine_args(s)

    b = sub.add_parser("batch", aliases=["run-batch"], formatter_class=_HelpFormatter,
                       help="answer a file of OpenAI batch requests (JSONL) offline "
                       "(run-batch: vLLM's name, answers in the input's order)",
                       description="Each input line is {\"custom_id\", \"method\": \"POST\", "
                       "\"url\": \"/v1/chat/completions\" | \"/v1/completions\" | "
                       "\"/v1/responses\" | \"/v1/embeddings\" | \"/v1/score\" | "
                       "\"/v1/rerank\", \"body\"}; each output line answers one, in the "
                       "order they finish (match them by custom_id), or in the input's order "
                       "with --in-order (`run-batch`, vLLM's command, always).")
    b.add_argument("-i", "--input", "--input-file", dest="input", required=True,
                   help="the requests, one JSON per line ('-': stdin)")
    b.add_argument("-o", "--output", "--output-file", dest="output", required=True,
                   help="where the answers go ('-': stdout)")
    b.add_argument("--concurrency", type=int, default=256,
                   help="requests in flight at once")
    b.add_argument("--in-order", action="store_true",
                   help="write the answers in the input's order (each waits for every earlier "
                   "line's; `run-batch` always does, as vLLM's)")
    b.add_argument("--resume", action="store_true",
                   help="the output file holds an interrupted run's answers: keep those with "
                   "status 200, drop the rest, and answer every line whose custom_id has none "
                   "(the new answers are appended)")
    b.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name the requests use (default: the model's name)")
    b.add_argument("--url", type=_server_url, default=None, metavar="URL",
                   help="send the requests to this running server (e.g. "
                   "http://127.0.0.1:8000) instead of loading a model here: the engine "
                   "options below are not used")
    b.add_argument("--api-key", default=os.environ.get("FERROBATCH_API_KEY"),
                   help="with --url: the server's key (default $FERROBATCH_API_KEY)")
    _log_level_arg(b, "warning")
    _engine_args(b)

    for name, helptext in (("generate", "generate a completion for one prompt"),
                           ("chat", "chat with the model in the terminal")):
        g = sub.add_parser(name, help=helptext, formatter_class=_HelpFormatter)
        if name == "generate":
            g.add_argument("prompt", help="prompt text")
        g.add_argument("--max-tokens", type=int, default=128 if name == "generate" else 256)
        g.add_argument("--temperature", type=float, default=None,
                       help="default: the model's (--generation-config), else 0 (greedy)")
        g.add_argument("--top-p", type=float, default=None)
        g.add_argument("--top-k", type=int, default=None)
        g.add_argument("--seed", type=int, default=None)
        if name == "chat":
            g.add_argument("--system", default=None, help="system prompt")
        _log_level_arg(g, "warning")
        o = g.add_argument_group("guided decoding (at most one)")
        o.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the output follows this JSON Schema (a file path or JSON text)")
        o.add_argument("--json", action="store_true", help="the output is a JSON object")
        o.add_argument("--regex", default=None, help="the output is a full match of this regex")
        o.add_argument("--grammar", default=None, metavar="GBNF",
                       help="the output follows this GBNF grammar (llama.cpp's format; a file "
                       "path or the grammar's text), from its root rule")
        o.add_argument("--choice", action="append", default=None, metavar="TEXT",
                       help="the output is one of these strings (repeat the flag)")
        _engine_args(g)
    return parser


async def _serve(a: argparse.Namespace) -> int:
    from ferrobatch.engine.async_engine import AsyncEngine
    from ferrobatch.serve.server import Server

    if a.api_key is not None and not a.api_key:
        raise ValueError("--api-key (or FERROBATCH_API_KEY) is empty; give a key or unset it")
    engine = AsyncEngine(_config(a))
    print(f"ferrobatch: loading {a.model} ...", flush=True)
    await engine.start()
    server = Server(engine, api_key=a.api_key, served_model_name=a.served_model_name,
                    allowed_origins=a.allowed_origins or frozenset(),
                    log_stats_interval_s=0.0 if a.disable_log_stats else a.log_stats_interval,
                    access_log=a.access_log, reasoning_parser=a.reasoning_parser,
                    allow_runtime_lora=a.allow_runtime_lora,
                    allow_weight_updates=a.allow_weight_updates,
                    vllm_metric_names=a.vllm_metric_names,
                    tool_call_parser=a.tool_call_parser,
                    return_tokens_as_token_ids=a.return_tokens_as_token_ids,
                    response_store=a.max_stored_responses if a.enable_response_store else 0,
                    batch_api=a.enable_batch_api, batch_max_file_mb=a.batch_max_file_mb,
                    batch_concurrency=a.batch_concurrency, batch_priority=a.batch_priority)
    try:
        adapters = _serve_lora_modules(engine, a, server.state.base_model_names)
    except ValueError:
        await engine.shutdown()
        raise
    try:
        await server.start(a.host, a.port, None if a.tcp_port < 0 else a.tcp_port)
    except OSError as exc:
        tcp = f", TCP port {a.tcp_port}" if a.tcp_port >= 0 else ""
        print(f"ferrobatch: cannot listen on {a.host} (HTTP port {a.port}{tcp}): {exc}",
              file=sys.stderr)
        await engine.shutdown()
        return 1
    base = f"http://{a.host}:{server.port}"
    print(f"ferrobatch: serving {server.state.model_name} (max_model_len "
          f"{engine.max_model_len}, attention backend {engine.attention_backend})")
    print(f"  KV cache: {engine.kv_cache}")
    print(f"  attention: {engine.attention_kernels}")
    print(f"  linear layers: {engine.linear_kernels}")
    print(f"  speculative decoding: {engine.speculation}")
    if adapters:
        print(f"  LoRA adapters: {', '.join(r.lora_name for r in adapters)} (model names)")
    print(f"  OpenAI HTTP : {base}/v1  (completions, chat/completions, responses, "
          "embeddings, models" + (", files, batches" if a.enable_batch_api else "") + ")")
    print(f"  also        : Anthropic {base}/v1/messages, Ollama {base}/api, SGLang "
          f"{base}/generate")
    print(f"  WebSocket   : ws://{a.host}:{server.port}/v1/ws")
    if server.tcp_port is not None:
        print(f"  msgpack/TCP : {a.host}:{server.tcp_port}")
    print(f"  health {base}/health  ready {base}/ready  metrics {base}/metrics", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dead = asyncio.create_task(_wait_dead(engine))
    await asyncio.wait([asyncio.create_task(stop.wait()), dead],
                       return_when=asyncio.FIRST_COMPLETED)
    failed = dead.done()
    print("ferrobatch: engine failed, shutting down" if failed
          else f"ferrobatch: draining (up to {a.drain_timeout:g}s) ...", flush=True)
    await server.stop(drain_timeout_s=0 if failed else a.drain_timeout)
    await engine.shutdown()
    print("ferrobatch: stopped", flush=True)
    return 1 if failed else 0


def _serve_lora_modules(engine: Any, a: argparse.Namespace, reserved: Any) -> list[Any]:
    """`--lora-modules`: each adapter served under its name (ValueError for a bad one)."""
    if not getattr(a, "lora_modules", None):
        return []
    from ferrobatch.serve.lora_api import serve_lora_modules
    return serve_lora_modules(engine, a.lora_modules, reserved)


async def _wait_dead(engine: Any) -> None:
    while engine.is_running:
        await asyncio.sleep(0.5)


async def _stream_one(engine: Any, params: SamplingParams, prompt: str | None = None,
                      messages: Any = None, lora_request: Any = None) -> str:
    text = []
    async for out in engine.generate(prompt, params, messages=messages,
                                     lora_request=lora_request):
        piece = out.outputs[0].text if out.outputs else ""
        text.append(piece)
        print(piece, end="", flush=True)
        if out.finished and out.error:
            print(f"\n[error: {out.error}]", file=sys.stderr)
    print()
    return "".join(text)


def _guided(a: argparse.Namespace) -> dict[str, Any]:
    """The guided-decoding fields of `generate` / `chat` (ValueError if more than one)."""
    given = [flag for flag, on in (("--json-schema", a.json_schema is not None),
                                   ("--json", a.json), ("--regex", a.regex is not None),
                                   ("--grammar", a.grammar is not None),
                                   ("--choice", a.choice is not None)) if on]
    if len(given) > 1:
        raise ValueError(f"use at most one of {', '.join(given)}")
    if a.json_schema is not None:
        # JSON text starts with "{"; anything else names a file
        return {"guided_json": _text_or_file(a.json_schema,
                                             a.json_schema.lstrip().startswith("{"))}
    if a.json:
        return {"guided_json": {"type": "object"}}
    if a.regex is not None:
        return {"guided_regex": a.regex}
    if a.grammar is not None:
        # a grammar's text has rules; anything else names a file
        return {"guided_grammar": _text_or_file(a.grammar, "::=" in a.grammar)}
    if a.choice is not None:
        return {"guided_choice": tuple(a.choice)}
    return {}


def _params(a: argparse.Namespace, model_defaults: dict[str, Any] | None = None
            ) -> SamplingParams:
    """`generate` / `chat`'s sampling: the flags given, then the model's defaults
    (`--generation-config`), then greedy."""
    from ferrobatch.model.generation_defaults import under_door_defaults
    given = {k: getattr(a, k) for k in ("temperature", "top_p", "top_k")
             if getattr(a, k) is not None}
    fields = {"temperature": 0.0, **under_door_defaults(model_defaults or {}, given)}
    return SamplingParams(**fields, max_tokens=a.max_tokens, seed=a.seed, output_kind="delta",
                          **_guided(a))


async def _batch(a: argparse.Namespace) -> int:
    from ferrobatch.batch import answer_lines, kept_answers, run_batch
    from ferrobatch.engine.async_engine import AsyncEngine

    if a.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if a.resume and a.output == "-":
        raise ValueError("--resume needs an output file (not '-')")
    total = None
    if a.input != "-":
        with open(a.input, encoding="utf-8") as f:  # FileNotFoundError: a one-line error
            total = sum(1 for line in f if line.strip())
    answered = kept_answers(a.output) if a.resume else set()
    source = sys.stdin if a.input == "-" else open(a.input, encoding="utf-8")  # noqa: SIM115
    sink = sys.stdout if a.output == "-" else \
        open(a.output, "a" if a.resume else "w", encoding="utf-8")  # noqa: SIM115

    def write(out: dict[str, Any]) -> None:
        sink.write(json.dumps(out, ensure_ascii=False) + "\n")
        sink.flush()

    summary = None
    options = {"concurrency": a.concurrency,
               "progress": "bar" if sys.stderr.isatty() else "lines",
               "in_order": a.in_order or a.command == "run-batch", "answered": answered,
               "total": total}
    try:
        if a.url is not None:               # a running server answers: no model loads here
            headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
            summary = await answer_lines(a.url, source, write, headers=headers, **options)
        else:
            async with AsyncEngine(_config(a)) as engine:
                _serve_lora_modules(engine, a, (a.served_model_name or engine.model_name,))
                summary = await run_batch(engine, source, write,
                                          served_model_name=a.served_model_name, **options)
    finally:
        if source is not sys.stdin:
            source.close()
        if sink is not sys.stdout:
            sink.close()
        if summary is None and sink is not sys.stdout:
            print(f"ferrobatch: stopped before every line was answered; `--resume` keeps "
                  f"what {a.output} holds and answers the rest", file=sys.stderr)
    resumed = f", {summary.skipped} answered before (--resume)" if a.resume else ""
    print(f"ferrobatch: {summary.total} requests, {summary.succeeded} answered, "
          f"{summary.failed} failed{resumed}", file=sys.stderr)
    return 0


async def _generate(a: argparse.Namespace) -> int:
    from ferrobatch.engine.async_engine import AsyncEngine
    _params(a)                                  # bad flags fail before the model loads
    async with AsyncEngine(_config(a)) as engine:
        params = _params(a, engine.default_sampling_fields)
        await _stream_one(engine, params, prompt=a.prompt, lora_request=_lora_request(a))
    return 0


async def _chat(a: argparse.Namespace) -> int:
    from ferrobatch.engine.async_engine import AsyncEngine
    _params(a)                                  # bad flags fail before the model loads
    history: list[dict[str, str]] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    async with AsyncEngine(_config(a)) as engine:
        params = _params(a, engine.default_sampling_fields)
        print("ferrobatch chat: empty line or Ctrl-D to quit", flush=True)
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            try:
                reply = await _stream_one(engine, params, messages=history,
                                          lora_request=_lora_request(a))
            except ValueError as exc:           # e.g. the conversation outgrew the context
                history.pop()
                print(f"ferrobatch: {exc}", file=sys.stderr, flush=True)
                continue
            history.append({"role": "assistant", "content": reply})
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, `serve MODEL` (vLLM's positional model) folded into `--model`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model not in ("smollm2", tag):
            parser.error(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:
        run = {"serve": _serve, "generate": _generate, "chat": _chat,
               "batch": _batch, "run-batch": _batch}[args.command]
        return asyncio.run(run(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"ferrobatch: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:                     # `ferrobatch generate ... | head`
        sys.stdout = open(os.devnull, "w")      # noqa: SIM115 - flushing at exit must not fail
        return 0
    except Exception as exc:  # noqa: BLE001 - a one-line error, no traceback (unless asked)
        if os.environ.get("FERROBATCH_DEBUG"):
            raise
        print(f"ferrobatch: {type(exc).__name__}: {exc} (FERROBATCH_DEBUG=1 shows the "
              "traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
