"""Online serving benchmark (vLLM `bench serve` conventions) over the OpenAI HTTP API.

    # launch each server in turn on a free loopback port, sweep request rates, compare:
    python benches/serving.py --servers ferrobatch,hf --workload cpu-serve \
        --request-rates 0.5,1,2,4,inf --num-prompts 40 --json benches/results/cpu/serving.json

    # or measure a server that is already running:
    python benches/serving.py --base-url http://127.0.0.1:8000 --request-rates 2

Arrivals are a Poisson process (exponential gaps, seeded; `inf` = all at once); each request is a
streaming `POST /v1/completions` with token-id prompts, `max_tokens` = its output length,
`ignore_eos`, greedy, `stream_options.include_usage`. Metrics as vLLM defines them: TTFT = first
chunk with choices; ITL = every later inter-chunk gap; TPOT = (e2e - ttft) / (tokens - 1); E2EL;
output tokens from the usage chunk. `--doors http,ws,tcp` also measures ferrobatch's WebSocket and
msgpack/TCP doors (through `ferrobatch.client`, one multiplexed connection, `delta` messages play
the part of chunks). Every (door, rate) run sends prompts no earlier run of the invocation sent
(`workloads.fresh_prompts`: same lengths, token ids rotated), so a prefix cache cannot serve one
run from another's blocks; all servers get the same prompts per run. Servers:
  ferrobatch      `python -m ferrobatch serve` (SmolLM2 on CPU)
  ferrobatch-f32  the same with `--no-gguf-blocks` (float32 weights only: the block kernel's ablation)
  hf          benches/hf_server.py: transformers' ContinuousBatchingManager behind the same API
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from argtypes import float_list, name_list, positive_float, positive_int
from common import REPO, load_1min, machine_info, write_json
from workloads import WORKLOADS, Request, build_requests, fresh_prompts, summarize

PY = sys.executable
SERVERS = ("ferrobatch", "ferrobatch-f32", "hf")
DOORS = ("http", "ws", "tcp")        # ferrobatch's; hf has http only


@dataclass
class ReqResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0


async def one_request(session, url: str, model: str, r: Request, timeout_s: float) -> ReqResult:
    import aiohttp
    body = {"model": model, "prompt": list(r.prompt_ids), "max_tokens": r.output_len,
            "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    res = ReqResult(prompt_len=len(r.prompt_ids))
    st = time.perf_counter()
    res.start = st
    last = st
    usage_tokens = None
    chunks = 0
    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        line = line.strip()
                        if not line or line.startswith(b":"):
                            continue
                        if line.startswith(b"data:"):
                            line = line[5:].strip()
                        if line == b"[DONE]":
                            continue
                        data = json.loads(line)
                        if "error" in data:
                            res.error = str(data["error"])[:200]
                            return res
                        now = time.perf_counter()
                        choices = data.get("choices")
                        if choices:
                            c = choices[0]
                            if c.get("text") or c.get("finish_reason") is None:
                                if chunks == 0:
                                    res.ttft = now - st
                                else:
                                    res.itl.append(now - last)
                                last = now
                                chunks += 1
                        if data.get("usage"):
                            usage_tokens = data["usage"].get("completion_tokens")
        res.latency = last - st
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no token received"
    except Exception as exc:  # noqa: BLE001 - every failure is counted, never fatal
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def one_request_door(client, r: Request, timeout_s: float) -> ReqResult:
    """One generation over ferrobatch's WebSocket or msgpack/TCP door (ferrobatch.client):
    TTFT = first `delta`, ITL = gaps between deltas, tokens = `done.usage.completion_tokens`."""
    res = ReqResult(prompt_len=len(r.prompt_ids))
    st = time.perf_counter()
    res.start = st
    last = st
    chunks = 0

    async def consume():
        nonlocal last, chunks
        async for m in client.generate(list(r.prompt_ids), max_tokens=r.output_len,
                                       ignore_eos=True, temperature=0.0):
            t = m.get("type")
            now = time.perf_counter()
            if t == "delta":
                if chunks == 0:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
            elif t == "done":
                res.output_tokens = int((m.get("usage") or {}).get("completion_tokens", chunks))
                res.ok = chunks > 0
            elif t in ("error", "cancelled"):
                res.error = f"{t}: {m.get('message', '')}"[:200]
    try:
        await asyncio.wait_for(consume(), timeout_s)
    except Exception as exc:  # noqa: BLE001
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    res.latency = last - st
    if not res.ok and not res.error:
        res.error = "no terminal message"
    return res


async def run_rate(url: str, model: str, reqs: list[Request], rate: float, seed: int,
                   max_concurrency: int | None, timeout_s: float, progress: bool,
                   door_client=None) -> dict:
    import aiohttp
    rng = np.random.default_rng(seed)
    if np.isinf(rate):
        gaps = np.zeros(len(reqs))
    else:
        gaps = rng.exponential(1.0 / rate, size=len(reqs))
        gaps[0] = 0.0
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(reqs), desc=f"rate {rate}", unit="req", file=sys.stderr)
    inflight = 0
    max_inflight = 0

    async def fire(session, r):
        nonlocal inflight, max_inflight
        async def go():
            nonlocal inflight, max_inflight
            inflight += 1
            max_inflight = max(max_inflight, inflight)
            try:
                if door_client is not None:
                    return await one_request_door(door_client, r, timeout_s)
                return await one_request(session, url, model, r, timeout_s)
            finally:
                inflight -= 1
                if bar is not None:
                    bar.update(1)
        if sem is None:
            return await go()
        async with sem:
            return await go()

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        tasks = []
        t0 = time.perf_counter()
        for r, g in zip(reqs, gaps):
            if g > 0:
                await asyncio.sleep(g)
            tasks.append(asyncio.create_task(fire(session, r)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return metrics(results, duration, rate, max_inflight)


def _stats(xs: list[float], scale: float = 1000.0) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p99": None, "std": None}
    a = np.asarray(xs) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99)), "std": float(a.std())}


def metrics(results: list[ReqResult], duration: float, rate: float, max_inflight: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return {
        "request_rate": "inf" if np.isinf(rate) else rate,
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_concurrent_requests": max_inflight,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpots),
        "itl_ms": _stats(itls), "e2el_ms": _stats([r.latency for r in ok]),
    }


def print_block(server: str, m: dict) -> None:
    def f(x):
        return "-" if x is None else f"{x:.2f}"
    print(f"============ Serving Benchmark Result: {server} @ {m['request_rate']} req/s ============")
    print(f"Successful requests:                     {m['completed']}")
    print(f"Failed requests:                         {m['failed']}")
    print(f"Benchmark duration (s):                  {m['duration_s']:.2f}")
    print(f"Request throughput (req/s):              {m['request_throughput']:.2f}")
    print(f"Output token throughput (tok/s):         {m['output_throughput']:.2f}")
    print(f"Total Token throughput (tok/s):          {m['total_token_throughput']:.2f}")
    print(f"Max concurrent requests:                 {m['max_concurrent_requests']}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2el_ms", "E2EL")):
        s = m[key]
        print(f"Mean / Median / P99 {name} (ms):".ljust(41)
              + f"{f(s['mean'])} / {f(s['median'])} / {f(s['p99'])}")
    if m["errors"]:
        print(f"Errors: {m['errors']}")


# -- launching servers -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, port: int, args, tcp_port: int | None = None) -> list[str]:
    if kind in ("ferrobatch", "ferrobatch-f32"):
        extra = ["--no-gguf-blocks"] if kind == "ferrobatch-f32" else []
        return [PY, "-m", "ferrobatch", "serve", "--model", args.model, "--host", "127.0.0.1",
                "--port", str(port), "--tcp-port", str(tcp_port or free_port()),
                "--max-num-seqs", str(args.max_num_seqs),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                *extra, *args.ferrobatch_args.split()]
    if kind == "hf":
        cmd = [PY, str(REPO / "benches" / "hf_server.py"), "--model", args.model,
               "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        return cmd
    raise SystemExit(f"unknown server {kind!r} (ferrobatch | ferrobatch-f32 | hf)")


def launch(cmd: list[str], env: dict, log_path: Path | None) -> subprocess.Popen:
    """Start a server in its own session (so the whole process group can be stopped)."""
    if log_path is None:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)
    with open(log_path, "w") as log:   # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


async def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import aiohttp
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with s.get(base + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"server at {base} not ready after {timeout_s} s")


async def model_name(base: str, fallback: str) -> str:
    import aiohttp
    try:
        async with aiohttp.ClientSession() as s, s.get(base + "/v1/models") as r:
            data = await r.json()
            return data["data"][0]["id"]
    except Exception:  # noqa: BLE001
        return fallback


async def open_door(door: str, base: str, tcp_port: int | None):
    from ferrobatch.client import TCPClient, WSClient
    try:
        if door == "ws":
            return await WSClient.connect(base.replace("http://", "ws://") + "/v1/ws")
        if door == "tcp":
            return await TCPClient.connect("127.0.0.1", tcp_port)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        raise SystemExit(f"cannot open the {door} door of {base}: {type(exc).__name__}: {exc}") \
            from None
    raise ValueError(door)


async def bench_server(name: str, base: str, reqs: list[Request], rates: list[float], args,
                       doors: tuple[str, ...] = ("http",), tcp_port: int | None = None) -> list:
    url = base + args.endpoint
    model = await model_name(base, args.model)
    out = []
    w = WORKLOADS[args.workload]
    for d, door in enumerate(doors):
        client = None if door == "http" else await open_door(door, base, tcp_port)
        label = name if door == "http" else f"{name}-{door}"
        try:
            # Warm-up (not measured): two short requests, with ids no measured run uses.
            warm = [Request(r.prompt_ids[:16], 4) for r in fresh_prompts(reqs[:2], w, 10_000)]
            await run_rate(url, model, warm, float("inf"), 0, None, args.timeout, False, client)
            for k, rate in enumerate(rates):
                # Every (door, rate) run sends prompts no earlier run sent: a server with a
                # prefix cache must not answer a later run from an earlier one's blocks. The
                # runs' prompts are the same for every server, so servers stay comparable.
                run_reqs = fresh_prompts(reqs, w, 1 + d * len(rates) + k)
                load = load_1min()
                m = await run_rate(url, model, run_reqs, rate, args.seed, args.max_concurrency,
                                   args.timeout, not args.no_progress, client)
                m.update(server=label, door=door, loadavg_1m_before=load,
                         loadavg_1m_after=load_1min())
                print_block(label, m)
                out.append(m)
        finally:
            if client is not None:
                await client.close()
    return out


def plot(results: list[dict], path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    if not any(m["request_rate"] != "inf" for m in results):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    servers = list(dict.fromkeys(m["server"] for m in results))
    for s in servers:
        ms = [m for m in results if m["server"] == s and m["request_rate"] != "inf"]
        if not ms:
            continue
        x = [m["request_rate"] for m in ms]
        axes[0].plot(x, [m["ttft_ms"]["p99"] for m in ms], "o-", label=f"{s} p99")
        axes[0].plot(x, [m["ttft_ms"]["median"] for m in ms], "x--", label=f"{s} median")
        axes[1].plot(x, [m["tpot_ms"]["p99"] for m in ms], "o-", label=f"{s} p99")
        axes[1].plot(x, [m["tpot_ms"]["median"] for m in ms], "x--", label=f"{s} median")
        axes[2].plot(x, [m["output_throughput"] for m in ms], "o-", label=s)
    axes[0].axhline(1000, color="grey", linestyle=":", linewidth=0.8)
    axes[0].set_yscale("log")
    for ax, title, unit in zip(axes, ("TTFT", "TPOT", "output throughput"),
                               ("ms", "ms", "tok/s")):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


async def amain(args) -> int:
    w = WORKLOADS[args.workload]
    base_reqs = build_requests(w)
    n = args.num_prompts if args.num_prompts is not None else len(base_reqs)
    # beyond the workload's own requests, repeats get fresh token ids (no prefix-cache hits)
    reqs = [fresh_prompts([base_reqs[i % len(base_reqs)]], w, i // len(base_reqs))[0]
            for i in range(n)]
    rates = args.request_rates
    info = machine_info()
    print(f"workload {w.name}: {n} requests ({summarize(reqs)['output_tokens']} output tokens); "
          f"rates {rates}; load(1m) {info['loadavg_1m_at_start']}", flush=True)
    results: list[dict] = []
    if args.base_url:
        results += await bench_server(args.base_url, args.base_url.rstrip("/"), reqs, rates, args,
                                      tuple(args.doors))
    for kind in args.servers or []:
        port, tcp_port = free_port(), free_port()
        cmd = server_command(kind, port, args, tcp_port)
        env = dict(os.environ, PYTHONPATH=str(REPO / "python"), HF_HUB_OFFLINE="1")
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        print(f"launching {kind}: {' '.join(cmd)}", flush=True)
        log_path = Path(args.log_dir) / f"server_{kind}.log" if args.log_dir else None
        proc = launch(cmd, env, log_path)
        try:
            base = f"http://127.0.0.1:{port}"
            await wait_ready(base, proc, args.startup_timeout)
            doors = tuple(args.doors) if kind.startswith("ferrobatch") else ("http",)
            results += await bench_server(kind, base, reqs, rates, args, doors, tcp_port)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    out = {"workload": {"name": w.name, "model": args.model, "num_prompts": n,
                        **summarize(reqs)},
           "machine": {**info, "loadavg_1m_at_end": load_1min()},
           # the launched servers' (null when only --base-url ran: its cap is not known here)
           "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "command": "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
           "results": results}
    if args.json:
        p = args.plot or str(Path(args.json).with_suffix("")) + "_latency.png"
        made = plot(results, p)
        if made:
            out["plot"] = os.path.relpath(made, REPO)
        write_json(args.json, out)
        print(f"json: {args.json}")
    return 0 if all(m["failed"] == 0 for m in results) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="an already running server (loopback)")
    ap.add_argument("--servers", type=name_list(SERVERS),
                    help="launch these in turn: ferrobatch,ferrobatch-f32,hf")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--doors", type=name_list(DOORS), default="http",
                    help="ferrobatch doors to measure: http,ws,tcp (hf has http only; "
                    "--base-url: http,ws)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workload", default="cpu-serve", choices=sorted(WORKLOADS))
    ap.add_argument("--num-prompts", type=positive_int)
    ap.add_argument("--request-rates", type=float_list, default="1,2,inf")
    ap.add_argument("--max-concurrency", type=positive_int)
    ap.add_argument("--max-num-seqs", type=positive_int,
                    help="launched servers' concurrency cap (both; default 16)")
    ap.add_argument("--max-num-batched-tokens", type=positive_int,
                    help="launched servers' per-step token budget (both; default 512)")
    ap.add_argument("--ferrobatch-args", default="", help="extra `ferrobatch serve` flags")
    ap.add_argument("--threads", type=positive_int, help="torch threads of the launched servers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=positive_float, default=600.0,
                    help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=positive_float, default=600.0)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--log-dir")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if not args.base_url and not args.servers:
        ap.error("give --base-url or --servers")
    if args.base_url and not args.base_url.startswith(("http://127.0.0.1", "http://localhost")):
        ap.error("loopback only")
    if args.base_url and "tcp" in args.doors:
        # the WebSocket door is on the HTTP port; the TCP door's port is the server's own flag
        ap.error("--doors tcp: the TCP door's port cannot be derived from --base-url "
                 "(measure it with --servers ferrobatch)")
    if args.servers:
        args.max_num_seqs = args.max_num_seqs or 16
        args.max_num_batched_tokens = args.max_num_batched_tokens or 512
    elif given := [f for f, v in (("--max-num-seqs", args.max_num_seqs),
                                  ("--max-num-batched-tokens", args.max_num_batched_tokens),
                                  ("--ferrobatch-args", args.ferrobatch_args),
                                  ("--threads", args.threads), ("--log-dir", args.log_dir)) if v]:
        ap.error(f"{', '.join(given)}: options of the launched servers (--servers), "
                 "not of --base-url")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
