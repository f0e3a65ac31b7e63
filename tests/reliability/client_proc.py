"""A separate client process for the storm: opens streams over HTTP/SSE and TCP, prints one
line once every stream has its first token, then waits to be killed (SIGKILL) by the test.
Bounded: it exits by itself after `--life-s` seconds. Loopback only."""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
from harness import Outcome, http_stream, tcp_stream


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--tcp-port", type=int, required=True)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--life-s", type=float, default=120)
    a = ap.parse_args()
    assert a.base.startswith("http://127.0.0.1:")
    outs = [Outcome("proc") for _ in range(a.streams)]
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(
            http_stream(s, a.base, a.prompt, a.max_tokens, o) if i % 2 == 0
            else tcp_stream(a.tcp_port, a.prompt, a.max_tokens, o)) for i, o in enumerate(outs)]
        await asyncio.wait_for(asyncio.gather(*(o.first_token.wait() for o in outs)), a.life_s)
        print("STREAMING", flush=True)
        await asyncio.wait(tasks, timeout=a.life_s)
    sys.exit(3)          # reaching here means nobody killed us


if __name__ == "__main__":
    asyncio.run(main())
