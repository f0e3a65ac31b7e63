"""Named, seeded benchmark workloads.

A workload is a list of requests (prompt token ids + the exact number of output tokens each must
produce; EOS is ignored everywhere so every system generates exactly that many) plus the model it
runs on. Prompts are random token ids (as `vllm bench --dataset-name random` does): with EOS ignored,
throughput does not depend on what the tokens say.

Everything is a pure function of the workload's seed, so two systems, two runs or two machines see
byte-identical requests (`requests_digest` proves it in the JSON).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

# Architectures of the `random:<name>` models (weights drawn at random, shape of the real model).
# They mirror what ferrobatch accepts as `random:<name>`; the Hugging Face baselines build the same
# shape with `LlamaConfig` (see hf_baselines.build_hf_model).
ARCHS: dict[str, dict] = {
    "llama3-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "head_dim": 128, "rope_theta": 500000.0, "max_position_embeddings": 8192,
                  "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "head_dim": 64, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                     "tie_word_embeddings": True, "rms_norm_eps": 1e-5},
    # Two layers, 64 wide: the smoke test's model (seconds on one core).
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "rope_theta": 10000.0, "max_position_embeddings": 2048,
             "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
}

# Vocabulary of the embedded GGUF (SmolLM2-135M-Instruct).
SMOLLM2_VOCAB = 49152


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    output_len: int


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    model: str                     # ferrobatch model name: "smollm2" or "random:<arch>"
    dtype: str                     # "float32" | "bfloat16"
    device: str                    # "cpu" | "cuda"
    num_requests: int
    prompt_len: tuple[int, int]    # inclusive range (uniform) or (median, max) for "lognormal"
    output_len: tuple[int, int]
    seed: int = 0
    length_dist: str = "uniform"   # "uniform" | "chat"
    # Engine knobs shared by `ferrobatch` and `ferrobatch-static` (the static batch size is
    # max_num_seqs, so the ablation changes only the refill policy, not the concurrency cap).
    # It is below num_requests on purpose: with every request admitted at once there is nothing
    # to refill and the ablation would measure nothing (use --max-num-seqs for peak numbers).
    max_num_seqs: int = 128
    # hf-static batch size (the best of a sweep on the target machine; see README "Results").
    hf_static_batch_size: int = 8
    engine_options: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        if self.model.startswith("random:"):
            return ARCHS[self.model.split(":", 1)[1]]["vocab_size"]
        return SMOLLM2_VOCAB


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("cpu-small", "32 random-token requests, prompts U[32,256], outputs U[16,256]",
             model="smollm2", dtype="float32", device="cpu", num_requests=32,
             prompt_len=(32, 256), output_len=(16, 256), max_num_seqs=16,
             hf_static_batch_size=8),
    Workload("cpu-chat", "48 requests with a chat-like length mix (log-normal prompts, median 160 "
             "tokens, and answers, median 96; ShareGPT-like long tail, clipped)",
             model="smollm2", dtype="float32", device="cpu", num_requests=48,
             prompt_len=(160, 1024), output_len=(96, 384), length_dist="chat",
             max_num_seqs=16, hf_static_batch_size=8),
    Workload("cpu-serve", "online serving on CPU: chat-turn sized prompts U[32,128], "
             "outputs U[16,128]",
             model="smollm2", dtype="float32", device="cpu", num_requests=64,
             prompt_len=(32, 128), output_len=(16, 128), max_num_seqs=16,
             hf_static_batch_size=8),
    Workload("gpu-8b", "256 requests, prompts U[128,1024], outputs U[32,512], Llama-3-8B shape",
             model="random:llama3-8b", dtype="bfloat16", device="cuda", num_requests=256,
             prompt_len=(128, 1024), output_len=(32, 512), max_num_seqs=128,
             hf_static_batch_size=64),
    Workload("gpu-small", "256 requests, prompts U[128,1024], outputs U[32,512], SmolLM2-135M shape",
             model="random:smollm2-135m", dtype="bfloat16", device="cuda", num_requests=256,
             prompt_len=(128, 1024), output_len=(32, 512), max_num_seqs=128,
             hf_static_batch_size=64),
    Workload("gpu-chat", "1000 requests with the chat-like length mix, Llama-3-8B shape",
             model="random:llama3-8b", dtype="bfloat16", device="cuda", num_requests=1000,
             prompt_len=(160, 2048), output_len=(96, 1024), length_dist="chat",
             max_num_seqs=256, hf_static_batch_size=64),
    # Harness self-test (tests/benches): 4 short requests on a two-layer random model.
    Workload("smoke", "4 requests, prompts U[4,12], outputs U[2,6], tiny random model",
             model="random:tiny", dtype="float32", device="cpu", num_requests=4,
             prompt_len=(4, 12), output_len=(2, 6), max_num_seqs=2, hf_static_batch_size=2),
]}


def _lengths(rng: np.random.Generator, w: Workload, which: str) -> np.ndarray:
    lo_or_median, hi = w.prompt_len if which == "prompt" else w.output_len
    n = w.num_requests
    if w.length_dist == "uniform":
        return rng.integers(lo_or_median, hi + 1, size=n)
    if w.length_dist == "chat":
        # Log-normal with the given median and sigma 0.8 (a long right tail, as in ShareGPT
        # conversations), clipped to [8, max].
        x = rng.lognormal(mean=np.log(lo_or_median), sigma=0.8, size=n)
        return np.clip(np.rint(x), 8, hi).astype(np.int64)
    raise ValueError(f"unknown length distribution {w.length_dist!r}")


def build_requests(w: Workload) -> list[Request]:
    """The workload's requests, a pure function of its seed."""
    rng = np.random.default_rng(w.seed)
    plens = _lengths(rng, w, "prompt")
    olens = _lengths(rng, w, "output")
    # Skip the lowest ids (special / control tokens) so no prompt contains a chat marker or EOS.
    lo = min(100, w.vocab_size // 4)
    reqs = []
    for p, o in zip(plens.tolist(), olens.tolist()):
        ids = rng.integers(lo, w.vocab_size, size=p).astype(np.int64).tolist()
        reqs.append(Request(tuple(ids), int(o)))
    return reqs


def fresh_prompts(reqs: list[Request], w: Workload, run: int) -> list[Request]:
    """The same requests (lengths, outputs) with token ids no earlier run has sent: each id is
    rotated by `run` steps of a large stride within the workload's id range, so run k's prompts
    share no prefix block with run j's (a server's prefix cache cannot serve a later run from an
    earlier one). Run 0 is `reqs` unchanged."""
    if run == 0:
        return list(reqs)
    lo = min(100, w.vocab_size // 4)
    span = w.vocab_size - lo
    shift = (run * 7919) % span or 1
    return [Request(tuple(lo + (t - lo + shift) % span for t in r.prompt_ids), r.output_len)
            for r in reqs]


def requests_digest(reqs: list[Request]) -> str:
    h = hashlib.sha256()
    for r in reqs:
        h.update(np.asarray(r.prompt_ids, dtype=np.int64).tobytes())
        h.update(r.output_len.to_bytes(4, "little"))
    return h.hexdigest()[:16]


def summarize(reqs: list[Request]) -> dict:
    p = np.array([len(r.prompt_ids) for r in reqs])
    o = np.array([r.output_len for r in reqs])
    return {"num_requests": len(reqs), "prompt_tokens": int(p.sum()), "output_tokens": int(o.sum()),
            "prompt_len_mean": float(p.mean()), "prompt_len_max": int(p.max()),
            "output_len_mean": float(o.mean()), "output_len_max": int(o.max()),
            "digest": requests_digest(reqs)}


def ideal_decode_steps(reqs: list[Request], cap: int, mode: str) -> int:
    """Decode steps an ideal scheduler needs with `cap` slots, one token per running request per
    step (prefill not counted): "continuous" = FCFS refill as soon as a slot frees,
    "longest-first" = the same admitting the longest max_tokens first, "static" = groups of
    `cap` in arrival order, each group lasting as long as its longest request."""
    import heapq
    outs = [r.output_len for r in reqs]
    if mode == "static":
        return sum(max(outs[i:i + cap]) for i in range(0, len(outs), cap))
    if mode == "longest-first":
        outs = sorted(outs, reverse=True)
    elif mode != "continuous":
        raise ValueError(mode)
    slots = [0] * min(cap, len(outs))
    end = 0
    for o in outs:
        t = heapq.heappop(slots)
        heapq.heappush(slots, t + o)
        end = max(end, t + o)
    return end
