"""The engine on the portable kernels alone (``FERROBATCH_CPU_ISA=portable``): what a CPU
without AVX2 runs, and all an ARM machine runs (the SIMD paths compile out there; ``make
test-aarch64`` checks that the crate builds for aarch64). Greedy replies are the SIMD paths'."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROMPTS = ["The capital of France is", "def fib(n):", "List three colors:"]

_SCRIPT = """
import json, sys
from ferrobatch import LLM, SamplingParams
from ferrobatch._scheduler import linear_isa
llm = LLM("smollm2")
outs = llm.generate(json.loads(sys.argv[1]), SamplingParams(temperature=0, max_tokens=16))
print(json.dumps({"isa": linear_isa(), "tokens": [o.outputs[0].token_ids for o in outs]}))
llm.close()
"""


def _greedy(isa: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FERROBATCH_CPU_ISA"}
    if isa is not None:
        env["FERROBATCH_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(PROMPTS)], env=env,
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_portable_kernels_give_the_simd_paths_greedy_tokens():
    portable, widest = _greedy("portable"), _greedy(None)
    assert portable["isa"] == "portable"
    assert portable["tokens"] == widest["tokens"]
    assert all(len(t) == 16 for t in portable["tokens"])
