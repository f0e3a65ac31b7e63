"""What each HTTP door costs beside the OpenAI route it translates to: the same conversation
through `/v1/chat/completions`, Anthropic's `/v1/messages`, Ollama's `/api/chat` and the
Responses API, and the same text through `/v1/completions`, SGLang's `/generate` and Ollama's
raw `/api/generate`, whole and streamed, on the real engine with the model replaced by
`engine_overhead.StubRunner` (no forward: what is left is the doors, the engine and HTTP).

    python benches/doors.py --json benches/results/cpu/doors_session39.json

Per door: the median latency of requests sent one at a time (`--sequential`), and the requests
per second of `--concurrency` clients sending `--requests` in all; rounds alternate the doors
(`--rounds`, medians over them). Every answer is checked to carry `--tokens` tokens. Ratios are
against the OpenAI route each door translates to, measured in the same run. The server runs on
its own event-loop thread, the clients on the main one (one process, as in production the
clients are elsewhere: both sides' costs are in the figures, equally for every door).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import positive_int
from common import format_table, load_1min, machine_info, write_json

QUESTION = "Name three colours, and say which one you like best."
RAW = "The capital of France is"
STUB_TOKEN = 260


def _chat_pair(tokens: int) -> dict[str, tuple[str, dict, str]]:
    """door -> (path, body, how its answer counts tokens); `stream` is added per run."""
    msgs = [{"role": "user", "content": QUESTION}]
    return {
        "openai-chat": ("/v1/chat/completions", {"model": "smollm2", "messages": msgs,
                                                 "max_tokens": tokens, "ignore_eos": True,
                                                 "temperature": 0}, "openai"),
        "anthropic": ("/v1/messages", {"model": "smollm2", "messages": msgs,
                                       "max_tokens": tokens, "ignore_eos": True,
                                       "temperature": 0}, "anthropic"),
        "ollama-chat": ("/api/chat", {"model": "smollm2", "messages": msgs, "options": {
            "num_predict": tokens, "temperature": 0}}, "ollama"),
        "responses": ("/v1/responses", {"model": "smollm2", "input": QUESTION,
                                        "max_output_tokens": tokens, "ignore_eos": True,
                                        "temperature": 0}, "responses"),
        "openai-completions": ("/v1/completions", {"model": "smollm2", "prompt": RAW,
                                                   "max_tokens": tokens, "ignore_eos": True,
                                                   "temperature": 0}, "openai"),
        "sglang-generate": ("/generate", {"text": RAW, "sampling_params": {
            "max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}, "sglang"),
        "ollama-generate": ("/api/generate", {"model": "smollm2", "prompt": RAW, "raw": True,
                                              "options": {"num_predict": tokens,
                                                          "temperature": 0}}, "ollama"),
    }


BASELINE = {"openai-chat": "openai-chat", "anthropic": "openai-chat",
            "ollama-chat": "openai-chat", "responses": "openai-chat",
            "openai-completions": "openai-completions",
            "sglang-generate": "openai-completions", "ollama-generate": "openai-completions"}


def _tokens(shape: str, stream: bool, raw: bytes) -> int:
    """The output tokens an answer reports (its usage, or its last event's)."""
    if not stream:
        obj = json.loads(raw)
        return {"openai": lambda: obj["usage"]["completion_tokens"],
                "anthropic": lambda: obj["usage"]["output_tokens"],
                "ollama": lambda: obj["eval_count"],
                "responses": lambda: obj["usage"]["output_tokens"],
                "sglang": lambda: obj["meta_info"]["completion_tokens"]}[shape]()
    if shape == "ollama":
        return json.loads(raw.strip().split(b"\n")[-1])["eval_count"]
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    datas = [json.loads(line[6:]) for e in events for line in e.split(b"\n")
             if line.startswith(b"data: {")]
    if shape == "anthropic":
        return next(d["usage"]["output_tokens"] for d in datas if d["type"] == "message_delta")
    if shape == "responses":
        return datas[-1]["response"]["usage"]["output_tokens"]
    if shape == "sglang":
        return datas[-1]["meta_info"]["completion_tokens"]
    return next(d["usage"]["completion_tokens"] for d in datas if d.get("usage"))


def start_server(max_num_seqs: int):
    """The stub-model engine's server on its own loop thread: (server, base URL, stop)."""
    import engine_overhead
    import ferrobatch.runtime.model_runner as mr
    from ferrobatch.engine.async_engine import AsyncEngine
    from ferrobatch.serve.server import Server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def start():
        real = mr.ModelRunner
        mr.ModelRunner = engine_overhead.StubRunner
        # every step's token " the" (SmolLM2's 260): streams carry text at every token, as a
        # model's do (the overhead bench's token 10 decodes to nothing)
        engine_overhead.STUB_TOKEN = STUB_TOKEN
        try:
            engine = AsyncEngine(model="smollm2", device="cpu", dtype="float32",
                                 max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                 num_blocks=max_num_seqs * 8 + 64, num_speculative_tokens=0)
            await engine.start()
        finally:
            mr.ModelRunner = real
        server = Server(engine, served_model_name="smollm2")
        await server.start("127.0.0.1", 0)
        return server

    server = run(start())

    def stop():
        async def go():
            await server.stop()
            await server.state.engine.shutdown()
        run(go())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return server, f"http://127.0.0.1:{server.port}", stop


async def _one(session, base: str, door: tuple[str, dict, str], stream: bool,
               tokens: int) -> None:
    path, body, shape = door
    body = {**body, "stream": stream}
    if stream and shape == "openai":
        body["stream_options"] = {"include_usage": True}      # (the count to check)
    async with session.post(base + path, json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {raw[:300]!r}")
    got = _tokens(shape, stream, raw)
    if got != tokens:
        raise RuntimeError(f"{path} (stream={stream}) answered {got} tokens, not {tokens}")


async def _measure(base: str, door, stream: bool, tokens: int, sequential: int,
                   concurrency: int, requests: int) -> tuple[float, float]:
    """(median seconds of one request alone, requests per second under load)."""
    import aiohttp
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        alone = []
        for _ in range(sequential):
            t0 = time.perf_counter()
            await _one(s, base, door, stream, tokens)
            alone.append(time.perf_counter() - t0)
        queue = list(range(requests))

        async def client():
            while queue:
                queue.pop()
                await _one(s, base, door, stream, tokens)
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return statistics.median(alone), requests / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=positive_int, default=16)
    ap.add_argument("--sequential", type=positive_int, default=20)
    ap.add_argument("--concurrency", type=positive_int, default=32)
    ap.add_argument("--requests", type=positive_int, default=128)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    doors = _chat_pair(args.tokens)
    server, base, stop = start_server(max(64, args.concurrency))
    samples: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    try:
        for stream in (False, True):                   # warm every door once
            for door in doors.values():
                asyncio.run(_measure(base, door, stream, args.tokens, 1, 2, 4))
        for r in range(args.rounds):
            for name, door in doors.items():
                for stream in (False, True):
                    samples.setdefault((name, stream), []).append(asyncio.run(_measure(
                        base, door, stream, args.tokens, args.sequential, args.concurrency,
                        args.requests)))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        stop()
    rows = []
    for (name, stream), got in samples.items():
        alone = statistics.median(x for x, _ in got)
        rate = statistics.median(y for _, y in got)
        base_alone = statistics.median(x for x, _ in samples[(BASELINE[name], stream)])
        base_rate = statistics.median(y for _, y in samples[(BASELINE[name], stream)])
        rows.append({"door": name, "stream": stream, "route": doors[name][0],
                     "baseline": BASELINE[name], "alone_ms": round(alone * 1e3, 2),
                     "alone_vs_baseline": round(alone / base_alone, 3),
                     "requests_per_s": round(rate, 1),
                     "rate_vs_baseline": round(rate / base_rate, 3)})
    print(format_table(rows, [("door", "door", ""), ("stream", "stream", ""),
                              ("alone_ms", "alone ms", ".2f"),
                              ("alone_vs_baseline", "x baseline", ".3f"),
                              ("requests_per_s", "req/s", ".1f"),
                              ("rate_vs_baseline", "x baseline", ".3f")]))
    if args.json:
        write_json(args.json, {"bench": "doors", "machine": machine_info(),
                               "load_1min": load_1min(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
