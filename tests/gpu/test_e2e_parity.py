"""End-to-end greedy parity on the GPU: SmolLM2 through ModelRunner(attn_backend="cuda") vs
transformers on the same GGUF weights (both float32 on CUDA), token for token.

``FERROBATCH_E2E_GGUF=<path>`` runs them on another llama-family GGUF instead of the shipped one,
e.g. SmolLM2's first blocks (``tests/gpu/truncate_gguf.py``) where the full file cannot travel.

The batch mixes chunked prefills and decodes (prefill/mixed kernel) and ends in decode-only steps
(split-KV decode kernel), so both attention paths and the cache write are on the critical path.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

NUM_NEW_TOKENS = 24
BLOCK_SIZE = 16
NUM_BLOCKS = 512
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a dragon who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "List three prime numbers greater than 100.",
    ("In the beginning of the twentieth century, physics underwent two revolutions. "
     "The first, relativity, changed our notions of space and time; the second, quantum "
     "mechanics, changed our notion of what can be known about a physical system. Together"),
    "A" * 3,
]

_MODEL_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model")


@pytest.fixture(scope="module")
def smollm2_cuda():
    try:
        from ferrobatch.model.loader import load_model, smollm2_gguf_path
        path = os.environ.get("FERROBATCH_E2E_GGUF") or smollm2_gguf_path()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 / model loader unavailable: {exc}")
    return path, load_model(path, device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_greedy(smollm2_cuda):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path, loaded = smollm2_cuda
    directory, filename = os.path.split(path)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=filename, dtype=torch.float32)
    except Exception:  # noqa: BLE001 - fall back to transformers' own GGUF checkpoint reader
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = transformers.AutoConfig.from_pretrained(directory, gguf_file=filename)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
        model.load_state_dict(tensors, strict=False)
        model.tie_weights()
    model = model.to("cuda").eval()
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    outs, log_softmax = [], []
    with torch.inference_mode():
        for ids in prompts:
            t = torch.tensor([ids], device="cuda")
            o = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=NUM_NEW_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(o[0, len(ids):].tolist())
            # teacher-forced over prompt + output: row p scores token p + 1
            log_softmax.append(model(o[:, :-1]).logits[0].float().log_softmax(-1).cpu())
    del model
    torch.cuda.empty_cache()
    return prompts, outs, log_softmax


def _run(loaded, backend: str, prompts, token_budget: int, graphs: bool = False):
    sys.path.insert(0, _MODEL_TESTS)
    try:
        from step_builder import ToyScheduler
    except ImportError as exc:
        pytest.skip(f"tests/model/step_builder.py unavailable: {exc}")
    from ferrobatch.runtime.model_runner import ModelRunner
    from ferrobatch.runtime.sampler import Sampler

    runner = ModelRunner(loaded, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, attn_backend=backend)
    assert runner.attn_backend.name == backend
    if graphs:
        runner.capture_decode_graphs(max_num_seqs=len(prompts), max_model_len=1024)
    sampler = Sampler(loaded.config.vocab_size, loaded.tokenizer.eos_token_ids, "cuda")
    sched = ToyScheduler(NUM_BLOCKS, BLOCK_SIZE, token_budget=token_budget, seed=7)
    seqs = [sched.add(i, p, NUM_NEW_TOKENS) for i, p in enumerate(prompts)]
    kinds = set()
    for _ in range(10_000):
        batch = sched.schedule()
        if batch is None:
            break
        qlens = np.diff(batch.query_start_loc)
        kinds.add("decode-only" if np.all(qlens == 1) else "prefill/mixed")
        logits = runner.execute(batch)
        sched.update(sampler.sample(logits, batch).token_ids)
    if graphs:
        assert runner.graph_steps > 0 and runner.graph_steps == runner.decode_graphs.replays
        kinds.add("graph")
    return [s.output_ids for s in seqs], kinds


def test_greedy_parity_cuda_backend_vs_transformers(smollm2_cuda, hf_greedy):
    _, loaded = smollm2_cuda
    prompts, expected, _ = hf_greedy
    got, kinds = _run(loaded, "cuda", prompts, token_budget=48)
    assert kinds == {"decode-only", "prefill/mixed"}, kinds
    mismatches = [(i, g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} prompts differ: {mismatches[:2]}"


def test_greedy_parity_with_decode_cuda_graphs(smollm2_cuda, hf_greedy):
    """The same run with decode steps replayed from captured CUDA graphs (6 sequences: buckets
    1, 2, 4, 6; the 3- and 5-sequence steps replay padded graphs)."""
    _, loaded = smollm2_cuda
    prompts, expected, _ = hf_greedy
    got, kinds = _run(loaded, "cuda", prompts, token_budget=48, graphs=True)
    assert kinds == {"decode-only", "prefill/mixed", "graph"}, kinds
    mismatches = [(i, g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} prompts differ: {mismatches[:2]}"


def test_engine_on_cuda_tokens_and_logprobs_match_transformers(smollm2_cuda, hf_greedy):
    """The whole engine on CUDA (EngineCore.build's GPU path, decode graphs captured and
    replayed, the sampler on the device): greedy tokens, their logprobs (top 5) and the
    prompts' logprobs against transformers' log_softmax."""
    from ferrobatch.engine.llm import LLM
    from ferrobatch.sampling_params import SamplingParams

    _, loaded = smollm2_cuda
    prompts, expected, reference = hf_greedy
    llm = LLM("smollm2", loaded_model=loaded, device="cuda", num_blocks=NUM_BLOCKS,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    try:
        outs = llm.generate(prompts, SamplingParams(
            max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5,
            prompt_logprobs=5), use_tqdm=False)
        runner = llm.engine._core.runner
        assert runner.decode_graphs is not None and runner.graph_steps > 0
    finally:
        llm.close()
    worst = 0.0
    for prompt, want, ref, out in zip(prompts, expected, reference, outs):
        c = out.outputs[0]
        assert c.token_ids == want
        scored = [(len(prompt) - 1 + k, e) for k, e in enumerate(c.logprobs)]
        scored += [(p - 1, e) for p, e in enumerate(out.prompt_logprobs) if e is not None]
        assert len(scored) == len(prompt) - 1 + NUM_NEW_TOKENS
        for row, e in scored:
            worst = max(worst, abs(e.logprob - float(ref[row, e.token_id])))
            values = torch.tensor([lp for _, lp in e.top])
            torch.testing.assert_close(values, ref[row].topk(5).values, atol=2e-3, rtol=0)
    assert worst < 2e-3, worst


def test_guided_decoding_on_cuda(smollm2_cuda):
    """Guided decoding with the sampler on the device: every sampled output is valid JSON for
    its schema, and a plain greedy row in the same batch keeps its unguided tokens."""
    import json

    from ferrobatch.engine.llm import LLM
    from ferrobatch.sampling_params import SamplingParams

    _, loaded = smollm2_cuda
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 30},
                             "age": {"type": "integer"}}}
    llm = LLM("smollm2", loaded_model=loaded, device="cuda", num_blocks=NUM_BLOCKS,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    try:
        plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        alone = llm.generate(["The capital of France is"], plain, use_tqdm=False)[0]
        guided = SamplingParams(max_tokens=80, temperature=1.0, seed=0, n=4,
                                guided_json=schema)
        outs = llm.generate(["A person as JSON:", "The capital of France is"], [guided, plain],
                            use_tqdm=False)
    finally:
        llm.close()
    for c in outs[0].outputs:
        assert c.finish_reason == "stop", c.text
        obj = json.loads(c.text)
        assert list(obj) == ["name", "age"] and isinstance(obj["age"], int)
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 30
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_speculative_decoding_on_cuda(smollm2_cuda):
    """Prompt-lookup drafts on the device (the paged prefill kernel checks them; such steps run
    eagerly beside the decode graphs): greedy outputs equal the plain engine's, and drafts were
    both accepted and refused."""
    from ferrobatch.engine.llm import LLM
    from ferrobatch.sampling_params import SamplingParams

    _, loaded = smollm2_cuda
    passage = ("The river Seine flows through Paris. Its banks are lined with old bookstalls, "
               "and in the evening the bridges light up one after another.")
    convs = [[{"role": "user", "content": f"Repeat exactly.\n\n{passage}"}],
             [{"role": "user", "content": "Write a short story about a dragon."}]]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    outputs, stats = {}, {}
    for drafts in (0, 3):
        llm = LLM("smollm2", loaded_model=loaded, device="cuda", num_blocks=NUM_BLOCKS,
                  max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
                  num_speculative_tokens=drafts, speculative_max_running=0)
        try:
            outputs[drafts] = [o.outputs[0].token_ids
                               for o in llm.chat(convs, params, use_tqdm=False)]
            stats[drafts] = llm.engine.stats()
        finally:
            llm.close()
    assert outputs[3] == outputs[0]
    assert 0 < stats[3]["num_accepted_tokens_total"] < stats[3]["num_draft_tokens_total"]


def test_cuda_backend_matches_torch_backend_logits(smollm2_cuda):
    """Same step through both backends: logits agree to fp32 attention accuracy."""
    sys.path.insert(0, _MODEL_TESTS)
    from step_builder import ToyScheduler

    from ferrobatch.runtime.model_runner import ModelRunner

    _, loaded = smollm2_cuda
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    logits = {}
    for backend in ("torch", "cuda"):
        runner = ModelRunner(loaded, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, attn_backend=backend)
        sched = ToyScheduler(NUM_BLOCKS, BLOCK_SIZE, token_budget=4096, seed=3)
        for i, p in enumerate(prompts):
            sched.add(i, p, 1)
        logits[backend] = runner.execute(sched.schedule()).double()
    err = float((logits["cuda"] - logits["torch"]).norm() / logits["torch"].norm())
    assert err < 1e-4, err


def test_weights_updated_in_place_under_cuda_graphs(smollm2_cuda, hf_greedy):
    """The engine on CUDA with decode graphs captured: an update of one layer changes what the
    replays compute (the graphs read the parameters by address), and the checkpoint read back
    from disk gives transformers' tokens again (written in session 38 without a device)."""
    from ferrobatch.engine.llm import LLM
    from ferrobatch.model.loader import load_model
    from ferrobatch.sampling_params import SamplingParams

    path, _ = smollm2_cuda
    prompts, expected, _ = hf_greedy
    loaded = load_model(path, device="cuda", dtype=torch.float32)   # its own: it is changed
    llm = LLM("smollm2", loaded_model=loaded, device="cuda", num_blocks=NUM_BLOCKS,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        runner = llm.engine._core.runner

        def greedy():
            steps = runner.graph_steps
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert runner.graph_steps > steps
            return [o.outputs[0].token_ids for o in outs]

        assert greedy() == expected
        o_proj = loaded.model.layers[0].self_attn.o_proj.weight
        llm.update_weights({"model.layers.0.self_attn.o_proj.weight":
                            torch.randn_like(o_proj) * 0.1})
        assert greedy() != expected
        llm.update_weights_from_disk(path)
        assert greedy() == expected
    finally:
        llm.close()
