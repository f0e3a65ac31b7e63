"""The Hugging Face transformers peers: `hf-static` and `hf-continuous`.

- `hf-static`: `model.generate` on fixed batches of `batch_size` requests taken in arrival order,
  left-padded to the longest prompt of the batch, each batch decoded to the longest requested output
  of the batch (`min_new_tokens = max_new_tokens`, so EOS never stops it). Only the tokens each
  request asked for are counted as output; the rest is the honest waste of static batching
  (reported as `wasted_tokens`).
- `hf-continuous`: transformers' own `ContinuousBatchingManager` (paged KV cache, `paged|sdpa`
  attention on CPU) fed with one `add_request(input_ids, max_new_tokens=n, eos_token_id=-1)` per
  request, so every request gets its own length and EOS is disabled (-1 = no EOS).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from common import smollm2_gguf_path
from workloads import ARCHS, Request, Workload

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_hf_model(w: Workload, device: str, seed: int = 0):
    """The workload's model in transformers: the real GGUF (dequantized, like ferrobatch) for
    `smollm2`, random weights of the same shape for `random:<arch>`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    dtype = _torch_dtype(w.dtype)
    if w.model == "smollm2":
        # Equivalent to from_pretrained(dir, gguf_file=...) without needing `accelerate`.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        path = smollm2_gguf_path()
        cfg = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                 attn_implementation="sdpa")
        state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if k != "lm_head.weight"]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"GGUF load mismatch: missing={missing} "
                               f"unexpected={result.unexpected_keys}")
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model = model.to(device=device, dtype=dtype)
    elif w.model == "random:tiny":
        # The exact weights ferrobatch loads (a saved Hugging Face directory).
        from bench_models import model_ref
        model = AutoModelForCausalLM.from_pretrained(model_ref(w), dtype=dtype,
                                                     attn_implementation="sdpa").to(device)
    elif w.model.startswith("random:"):
        arch = dict(ARCHS[w.model.split(":", 1)[1]])
        arch["rope_parameters"] = {"rope_type": "default", "rope_theta": arch.pop("rope_theta")}
        cfg = LlamaConfig(**arch, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    else:
        raise ValueError(f"unsupported model {w.model!r}")
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def run_hf_static(model, reqs: list[Request], batch_size: int,
                  progress: Callable[[int], None] | None = None) -> dict:
    """Fixed padded batches in arrival order; returns timing + waste + per-step occupancy."""
    import torch

    device = model.device
    generated = 0
    useful_per_step: list[int] = []   # requests still owed a token at each decode step
    rows_per_step: list[int] = []     # rows actually computed at each step
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i:i + batch_size]
            max_prompt = max(len(r.prompt_ids) for r in batch)
            max_new = max(r.output_len for r in batch)
            ids = torch.zeros((len(batch), max_prompt), dtype=torch.long)
            mask = torch.zeros((len(batch), max_prompt), dtype=torch.long)
            for j, r in enumerate(batch):   # left padding
                ids[j, max_prompt - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                mask[j, max_prompt - len(r.prompt_ids):] = 1
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            n_new = out.shape[1] - max_prompt
            if n_new != max_new:
                raise RuntimeError(f"hf-static generated {n_new} tokens, expected {max_new}")
            generated += n_new * len(batch)
            for s in range(max_new):
                useful_per_step.append(sum(1 for r in batch if r.output_len > s))
                rows_per_step.append(len(batch))
            if progress:
                progress(len(batch))
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    requested = sum(r.output_len for r in reqs)
    return {"elapsed_s": elapsed, "output_tokens": requested, "generated_tokens": generated,
            "wasted_tokens": generated - requested, "num_steps": len(rows_per_step),
            "occupancy": useful_per_step, "batch_rows": rows_per_step,
            "params": {"batch_size": batch_size, "padding": "left", "attn": "sdpa",
                       "cache": "DynamicCache"}}


def hf_cb_config(w: Workload, reqs: list[Request], max_batch_tokens: int, page_size: int = 64):
    """ContinuousBatchingConfig sized like ferrobatch's run: same concurrency cap
    (`max_num_seqs`), same per-step token budget, enough KV pages that nobody is evicted."""
    from transformers.generation import ContinuousBatchingConfig

    longest = max(len(r.prompt_ids) + r.output_len for r in reqs)
    concurrent = min(w.max_num_seqs, len(reqs))
    pages_per_req = -(-longest // page_size) + 1
    on_gpu = w.device == "cuda"
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=concurrent * pages_per_req + 16,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=concurrent,
        use_cuda_graph=None if on_gpu else False,
        auto_switch_to_flash=on_gpu,
        allow_block_sharing=False,   # random prompts share no prefix; ferrobatch's cache is off too
    )


def run_hf_continuous(model, reqs: list[Request], cb_config,
                      progress: Callable[[int], None] | None = None) -> dict:
    """All requests submitted at once to transformers' ContinuousBatchingManager."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in reqs),
                           eos_token_id=-1, pad_token_id=0)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cb_config)
        manager.start()
        try:
            t0 = time.perf_counter()
            ids = [manager.add_request(input_ids=list(r.prompt_ids), request_id=f"r{i}",
                                       max_new_tokens=r.output_len, eos_token_id=-1)
                   for i, r in enumerate(reqs)]
            if any(x is None for x in ids):
                raise RuntimeError("hf-continuous refused a request")
            want = {f"r{i}": r.output_len for i, r in enumerate(reqs)}
            got: dict[str, int] = {}
            while len(got) < len(reqs):
                res = manager.get_result(timeout=1.0)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread died")
                    continue
                if res.is_finished():
                    if res.error:
                        raise RuntimeError(f"hf-continuous request {res.request_id}: {res.error}")
                    got[res.request_id] = len(res.generated_tokens)
                    if progress:
                        progress(1)
            elapsed = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()
    bad = {k: (got[k], want[k]) for k in want if got.get(k) != want[k]}
    if bad:
        raise RuntimeError(f"hf-continuous generated the wrong number of tokens: "
                           f"{dict(list(bad.items())[:4])}")
    total = sum(want.values())
    return {"elapsed_s": elapsed, "output_tokens": total, "generated_tokens": total,
            "wasted_tokens": 0,
            "params": {"page_size": cb_config.page_size, "num_blocks": cb_config.num_blocks,
                       "max_batch_tokens": cb_config.max_batch_tokens,
                       "max_requests_per_batch": cb_config.max_requests_per_batch,
                       "attn": model.config._attn_implementation}}
