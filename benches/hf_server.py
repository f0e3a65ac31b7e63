"""A minimal OpenAI-style streaming server around transformers' ContinuousBatchingManager.

The transformers peer of `benches/serving.py`: `POST /v1/completions` (token-id or text prompt,
`max_tokens`, `stream`, `stream_options.include_usage`, `ignore_eos`) streamed as SSE, one chunk
per generated token, plus `GET /health` and `GET /v1/models`. Greedy only. Loopback only.

    python benches/hf_server.py --model smollm2 --port 8100 --max-num-seqs 16

It exists only to give transformers the same HTTP door as ferrobatch in the serving benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from aiohttp import web


def build(args):
    import dataclasses

    import torch
    from transformers import GenerationConfig

    from hf_baselines import build_hf_model, hf_cb_config
    from workloads import WORKLOADS, Request

    if args.threads:
        torch.set_num_threads(args.threads)
    base = WORKLOADS["cpu-small"] if args.model == "smollm2" else WORKLOADS["smoke"]
    w = dataclasses.replace(base, model=args.model, max_num_seqs=args.max_num_seqs)
    model = build_hf_model(w, "cpu")
    tokenizer = _tokenizer(args.model)
    # KV sized for max_num_seqs requests of up to max_model_len tokens.
    cfg = hf_cb_config(w, [Request((0,) * (args.max_model_len - 1), 1)] * args.max_num_seqs,
                       args.max_num_batched_tokens)
    gen = GenerationConfig(do_sample=False, max_new_tokens=256, eos_token_id=-1, pad_token_id=0)
    torch.set_grad_enabled(False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    manager.start()
    return model, tokenizer, manager


def _tokenizer(model: str):
    from transformers import AutoTokenizer
    if model == "smollm2":
        from common import smollm2_gguf_path
        p = smollm2_gguf_path()
        return AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p))
    from bench_models import materialize_tiny_hf_dir
    return AutoTokenizer.from_pretrained(materialize_tiny_hf_dir())


def make_app(model, tokenizer, manager, model_name: str) -> web.Application:
    ids = itertools.count()
    eos = tokenizer.eos_token_id

    async def health(_req):
        return web.json_response({"status": "ok"} if manager.is_running() else {"status": "dead"},
                                 status=200 if manager.is_running() else 503)

    async def models(_req):
        return web.json_response({"object": "list", "data": [{"id": model_name, "object": "model"}]})

    async def completions(req: web.Request):
        body = await req.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            prompt_ids = prompt
        else:
            return web.json_response({"error": {"message": "prompt must be text or token ids",
                                                "type": "invalid_request_error"}}, status=400)
        max_tokens = int(body.get("max_tokens") or 16)
        stream = bool(body.get("stream"))
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        rid = f"cmpl-{next(ids)}"
        q: asyncio.Queue = asyncio.Queue()
        manager.register_result_handler(rid, q.put_nowait)
        manager.add_request(input_ids=list(prompt_ids), request_id=rid, max_new_tokens=max_tokens,
                            streaming=stream,
                            eos_token_id=-1 if body.get("ignore_eos") else eos)
        created = int(time.time())
        if not stream:
            while True:
                out = await q.get()
                if out.is_finished():
                    break
            toks = list(out.generated_tokens)
            return web.json_response({
                "id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "text": tokenizer.decode(toks), "logprobs": None,
                             "finish_reason": "length" if len(toks) >= max_tokens else "stop"}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(toks),
                          "total_tokens": len(prompt_ids) + len(toks)}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(req)
        sent = 0
        try:
            while True:
                out = await q.get()
                toks = list(out.generated_tokens)
                if len(toks) > sent:
                    chunk = {"id": rid, "object": "text_completion", "created": created,
                             "model": model_name,
                             "choices": [{"index": 0, "text": tokenizer.decode(toks[sent:]),
                                          "logprobs": None, "finish_reason": None}]}
                    if usage_wanted:
                        chunk["usage"] = None
                    sent = len(toks)
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if out.is_finished():
                    break
            final = {"id": rid, "object": "text_completion", "created": created,
                     "model": model_name,
                     "choices": [{"index": 0, "text": "", "logprobs": None,
                                  "finish_reason": "length" if sent >= max_tokens else "stop"}]}
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            if usage_wanted:
                usage = {"id": rid, "object": "text_completion", "created": created,
                         "model": model_name, "choices": [],
                         "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": sent,
                                   "total_tokens": len(prompt_ids) + sent}}
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            manager.cancel_request(rid)
            raise
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "random:tiny"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("hf_server.py is a benchmark helper: loopback only")
    model, tokenizer, manager = build(args)
    try:
        web.run_app(make_app(model, tokenizer, manager, args.model), host=args.host,
                    port=args.port, print=lambda *a: print(*a, flush=True))
    finally:
        manager.stop(block=True, timeout=10)


if __name__ == "__main__":
    main()
