"""LoRA adapters (PEFT format) on SmolLM2: greedy output equals transformers' with the adapter
merged into the weights (PEFT's ``merge_and_unload`` arithmetic), token for token; base and
several adapters in one batch each give what they give alone; the prefix cache never serves
one adapter's KV to another; slots are reused least-recently-used first; bad adapters are clear
errors."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_support import REAL_ENGINE_OPTIONS  # noqa: E402
from lora_files import ATTN, MLP, merge_into, module_dims, write_peft_adapter  # noqa: E402

from ferrobatch.lora_request import LoRARequest  # noqa: E402
from ferrobatch.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 20
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there"]
# (targets, r, alpha, rslora, seed): the PEFT default (q, v), every projection, rsLoRA
ADAPTERS = {"qv": (("q_proj", "v_proj"), 8, 16, False, 1),
            "all": (ATTN + MLP, 4, 8, False, 2),
            "rs": (("k_proj", "o_proj", "down_proj"), 16, 4, True, 3)}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, loaded_smollm2):
    """name -> (LoRARequest, {(layer, module): (A, B)}, scale)."""
    cfg = loaded_smollm2.config
    out = {}
    for i, (name, (targets, r, alpha, rslora, seed)) in enumerate(ADAPTERS.items()):
        path = str(tmp_path_factory.mktemp(f"lora-{name}"))
        pairs = write_peft_adapter(path, cfg, targets=targets, r=r, alpha=alpha, seed=seed,
                                   use_rslora=rslora, b_std=0.03)
        scale = alpha / (r ** 0.5 if rslora else r)
        out[name] = (LoRARequest(name, i + 1, path), pairs, scale)
    return out


@pytest.fixture(scope="module")
def llm(loaded_smollm2):
    from ferrobatch.engine.llm import LLM
    with LLM("smollm2", loaded_model=loaded_smollm2, enable_lora=True, max_loras=2,
             **REAL_ENGINE_OPTIONS) as llm:
        yield llm


def _ids(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=True)


def _hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def oracle(hf_oracle_model, adapters, llm):
    """(adapter name or None, prompt index) -> transformers' greedy tokens, the adapter merged
    into a copy of the weights."""
    hf_oracle_model.generation_config.eos_token_id = None
    ids = [_ids(llm, t) for t in PROMPTS]
    want = {(None, i): _hf_greedy(hf_oracle_model, p) for i, p in enumerate(ids)}
    for name, (_, pairs, scale) in adapters.items():
        merged = copy.deepcopy(hf_oracle_model)
        merge_into(merged, pairs, scale)
        for i, p in enumerate(ids):
            want[(name, i)] = _hf_greedy(merged, p)
        del merged
    return want


def _greedy(llm, prompts, loras):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": _ids(llm, PROMPTS[i])} for i in prompts], params,
                        use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_output_equals_transformers_with_merged_weights(llm, adapters, oracle, name):
    request = adapters[name][0]
    # the base model saw these prompts first: its cached blocks must not stand in for them
    assert _greedy(llm, [0, 1, 2], None) == [oracle[(None, i)] for i in range(3)]
    got = _greedy(llm, [0, 1, 2], request)
    assert got == [oracle[(name, i)] for i in range(3)]
    assert got != [oracle[(None, i)] for i in range(3)], "the adapter changed nothing"
    assert llm.engine.check_accounting()["tracked_extras"] == 0
    assert llm.engine.loras.num_refs == 0


def test_base_and_adapters_in_one_batch(llm, adapters, oracle):
    """Six requests (base and two adapters, two prompts each) in one generate call: each row
    gets its own adapter's update and nothing else."""
    qv, everything = adapters["qv"][0], adapters["all"][0]
    loras = [None, qv, everything, everything, qv, None]
    prompts = [0, 1, 2, 0, 2, 1]
    got = _greedy(llm, prompts, loras)
    names = [None if r is None else r.lora_name for r in loras]
    assert got == [oracle[(n, i)] for n, i in zip(names, prompts)]


def test_lora_steps_run_in_the_fused_cpu_step(llm, adapters, oracle):
    """On the CPU, steps with adapter rows (mixed with base rows too) stay in the fused Rust
    step (``cpu_lora``), and still give transformers' merged tokens."""
    runner = llm.engine._core.runner
    fused = runner.fused_layers
    before = (fused.steps, runner.eager_steps)
    loras = [adapters["qv"][0], None, adapters["all"][0]]
    got = _greedy(llm, [0, 1, 2], loras)
    assert got == [oracle[("qv", 0)], oracle[(None, 1)], oracle[("all", 2)]]
    assert fused.steps - before[0] == runner.eager_steps - before[1] > 0


def test_slots_are_reused_least_recently_used_first(llm, adapters, oracle):
    """max_loras=2 with three adapters: each new one evicts the idle adapter used least
    recently, and a reloaded adapter computes what it did before."""
    loras = llm.engine.loras
    loads = loras.loads
    for name in ("qv", "all", "rs", "qv"):
        assert _greedy(llm, [0], adapters[name][0]) == [oracle[(name, 0)]]
        loaded = [e["name"] for e in loras.loaded()]
        assert len(loaded) <= 2 and loaded[-1] == name
        loras.check()
    assert loras.loads > loads and loras.evictions >= 1
    assert loras.num_refs == 0


def test_more_adapters_than_slots_wait_for_one(llm, adapters, oracle):
    """Three adapters at once with two slots: the third waits (accepted) until a running
    request releases its slot, then computes what it computes alone."""
    names = ["qv", "all", "rs", "qv", "rs"]
    got = _greedy(llm, [0, 1, 2, 1, 0], [adapters[n][0] for n in names])
    assert got == [oracle[(n, i)] for n, i in zip(names, [0, 1, 2, 1, 0])]
    llm._run(llm.engine.check_idle_clean())
    assert llm.engine.stats()["num_lora_waiting_requests"] == 0


def test_waiting_request_aborted_or_failed_leaves_nothing(llm, adapters, tmp_path):
    """A request waiting for a slot that is aborted ends at once; one whose adapter fails to
    load when its turn comes ends with that error; the engine goes on."""
    engine = llm.engine
    broken = tmp_path / "broken"
    broken.mkdir()

    async def run():
        long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        busy = [engine.add_request(PROMPTS[0], long, lora_request=adapters[n][0])
                for n in ("qv", "all")]
        waiting = engine.add_request(PROMPTS[1], long, lora_request=adapters["rs"][0])
        doomed = engine.add_request(PROMPTS[1], long,
                                    lora_request=LoRARequest("broken", 99, str(broken)))
        assert engine.stats()["num_lora_waiting_requests"] == 2
        engine.check_accounting()
        waiting.abort()
        assert engine.stats()["num_lora_waiting_requests"] == 1
        outs = []
        for stream in (waiting, *busy, doomed):
            outs.append([o async for o in stream][-1])
        return outs
    aborted, first, second, failed = llm._run(run())
    assert aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids == []
    assert [len(o.outputs[0].token_ids) for o in (first, second)] == [64, 64]
    assert failed.outputs[0].finish_reason == "error"
    assert "adapter_config.json" in (failed.error or "")
    llm._run(engine.check_idle_clean())


def test_a_waiting_adapter_is_not_starved_by_busy_ones(llm, adapters):
    """Two slots held by running requests (qv ends after 40 tokens, all after 160); a request
    for a third adapter waits, and new qv requests arriving after it (that alone would keep qv
    busy past 160 tokens) queue behind it: qv, the least recently used adapter, drains at 40 and
    the waiting request runs then, long before all's request ends."""
    engine = llm.engine

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                              output_kind="final")

    async def run():
        import asyncio
        finished = []

        async def drain(name, stream):
            out = [o async for o in stream][-1]
            finished.append(name)
            return out
        qv, everything, rs = (adapters[n][0] for n in ("qv", "all", "rs"))
        tasks = [asyncio.ensure_future(drain("qv-40", engine.add_request(
                     PROMPTS[0], params(40), lora_request=qv))),
                 asyncio.ensure_future(drain("all-160", engine.add_request(
                     PROMPTS[1], params(160), lora_request=everything)))]
        await asyncio.sleep(0.2)
        tasks.append(asyncio.ensure_future(drain("rs", engine.add_request(
            PROMPTS[2], params(4), lora_request=rs))))
        assert engine.stats()["num_lora_waiting_requests"] == 1
        tasks += [asyncio.ensure_future(drain(f"qv-{n}", engine.add_request(
            PROMPTS[0], params(n), lora_request=qv))) for n in (170, 180)]
        assert engine.stats()["num_lora_waiting_requests"] == 3
        await asyncio.gather(*tasks)
        return finished
    finished = llm._run(run())
    assert finished.index("rs") < finished.index("all-160"), finished
    assert finished[-2:] == ["qv-170", "qv-180"]
    llm._run(engine.check_idle_clean())


def test_same_id_for_another_adapter_is_refused(llm, adapters):
    qv = adapters["qv"][0]
    _greedy(llm, [0], qv)
    other = LoRARequest("other", qv.lora_int_id, adapters["all"][0].lora_path)
    with pytest.raises(ValueError, match="already adapter"):
        _greedy(llm, [0], other)


def test_lora_without_enable_lora_is_a_clear_error(loaded_smollm2, adapters):
    from ferrobatch.engine.llm import LLM
    with LLM("smollm2", loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as plain:
        with pytest.raises(ValueError, match="enable_lora"):
            _greedy(plain, [0], adapters["qv"][0])
        assert plain.engine.check_accounting()["open"] == 0


# -- reading adapters (no engine) ---------------------------------------------------------------

def test_fused_slices_carry_each_modules_update(tmp_path, loaded_smollm2):
    """The stacked A and block-placed B of a fused module add exactly ``scale * B @ A x`` to
    each HF module's slice of the fused output, and nothing to the other slices."""
    from ferrobatch.model.lora_adapter import read_lora_adapter
    cfg = loaded_smollm2.config
    pairs = write_peft_adapter(str(tmp_path), cfg, targets=("q_proj", "v_proj", "up_proj"),
                               r=4, alpha=12, layers=[0, 5])
    adapter = read_lora_adapter(str(tmp_path), cfg)
    assert adapter.rank == 4 and adapter.modules == ["qkv_proj", "gate_up_proj"]
    assert adapter.layers[1] == {} and set(adapter.layers[5]) == {"qkv_proj", "gate_up_proj"}
    dims = module_dims(cfg)
    q, kv, inter = dims["q_proj"][1], dims["k_proj"][1], dims["up_proj"][1]
    offsets = {"q_proj": (0, q), "v_proj": (q + kv, q + 2 * kv), "up_proj": (inter, 2 * inter)}
    x = torch.randn(3, cfg.hidden_size)
    for layer in (0, 5):
        for fused, modules in (("qkv_proj", ("q_proj", "v_proj")), ("gate_up_proj", ("up_proj",))):
            w = adapter.layers[layer][fused]
            size = q + 2 * kv if fused == "qkv_proj" else 2 * inter
            got = (x @ w.a_t) @ w.b_t
            want = torch.zeros(3, size)
            for m in modules:
                a, b = pairs[(layer, m)]
                lo, hi = offsets[m]
                want[:, lo:hi] = 3.0 * (x @ a.T @ b.T)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "only LORA"),
    ({"r": 0}, "r must be a positive number"),
])
def test_adapter_configs_it_cannot_apply_are_refused(tmp_path, loaded_smollm2, change, message):
    from ferrobatch.model.lora_adapter import read_lora_adapter
    write_peft_adapter(str(tmp_path), loaded_smollm2.config, layers=[0], extra_config=change)
    with pytest.raises(ValueError, match=message):
        read_lora_adapter(str(tmp_path), loaded_smollm2.config)


def test_bad_adapter_files_are_clear_errors(tmp_path, loaded_smollm2):
    from safetensors.torch import save_file

    from ferrobatch.model.lora_adapter import read_lora_adapter
    cfg = loaded_smollm2.config
    with pytest.raises(ValueError, match="does not exist"):
        read_lora_adapter(str(tmp_path / "missing"), cfg)
    (tmp_path / "adapter.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a directory"):
        read_lora_adapter(str(tmp_path / "adapter.bin"), cfg)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_lora_adapter(str(tmp_path), cfg)
    write_peft_adapter(str(tmp_path), cfg, layers=[0], r=8)
    with pytest.raises(ValueError, match="above max_lora_rank 4"):
        read_lora_adapter(str(tmp_path), cfg, max_rank=4)
    os.remove(tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickle"):
        read_lora_adapter(str(tmp_path), cfg)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    for tensors, message in (
            ({key.format("A"): torch.zeros(8, 7), key.format("B"): torch.zeros(576, 8)},
             "do not fit"),
            ({key.format("A"): torch.zeros(8, 576)}, "without its pair"),
            ({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 576)}, "not a LoRA A/B"),
            ({key.replace("layers.0", "layers.99").format("A"): torch.zeros(8, 576)},
             "layer 99")):
        save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=message):
            read_lora_adapter(str(tmp_path), cfg)
    (tmp_path / "adapter_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a JSON object"):
        read_lora_adapter(str(tmp_path), cfg)


def test_lora_request_fields_are_checked():
    for args, message in ((("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"),
                          (("a", True, "/x"), "lora_int_id"), (("a", 1, ""), "lora_path")):
        with pytest.raises(ValueError, match=message):
            LoRARequest(*args)


def test_stacked_step_equals_each_rows_own_adapter():
    """Three adapters of different ranks and modules stacked, rows interleaved (the gather
    path) and in one run (the view path): each row gains its own adapter's update only, base
    rows nothing; adapters lacking a module in a layer add nothing there."""
    from ferrobatch.model.lora_adapter import LoraAdapter, LoraWeights
    from ferrobatch.runtime.lora import LayerLora, LoraHooks, LoraSlots, lora_step

    gen = torch.Generator().manual_seed(0)
    dim_in, dim_out, num_layers = 12, 10, 2

    def weights(rank):
        return LoraWeights(torch.randn(dim_in, rank, generator=gen),
                           torch.randn(rank, dim_out, generator=gen))
    adapters = {2: LoraAdapter("a", 2, [{"o_proj": weights(2)}, {}]),
                3: LoraAdapter("b", 5, [{"o_proj": weights(5)}, {"o_proj": weights(5)}]),
                4: LoraAdapter("c", 3, [{}, {"o_proj": weights(3)}])}
    slots = LoraSlots(num_layers, 4)
    for slot, adapter in adapters.items():
        slots.put(slot, adapter)
    assert slots.stacked.slots == (2, 3, 4) and slots.stacked.widths["o_proj"] == 5
    hooks = LoraHooks()
    x = torch.randn(7, dim_in, generator=gen)
    for seq_slots in ([3, 0, 2, 4, 3, 0, 2], [0, 0, 3, 3, 3, 0, 0], [2, 2, 2, 2, 2, 2, 2]):
        starts = list(range(8))             # one token per sequence
        step = lora_step(slots.stacked, starts, seq_slots, torch.device("cpu"))
        for layer in range(num_layers):
            base = torch.randn(7, dim_out, generator=gen)
            want = base.clone()
            for row, slot in enumerate(seq_slots):
                w = adapters[slot].layers[layer].get("o_proj") if slot else None
                if w is not None:
                    want[row] += (x[row] @ w.a_t) @ w.b_t
            with hooks.step(step):
                got = LayerLora(hooks, layer).add("o_proj", x, base.clone())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert isinstance(lora_step(slots.stacked, starts, [0, 0, 3, 3, 3, 0, 0],
                                torch.device("cpu")).rows, slice)
    assert lora_step(slots.stacked, starts, [0] * 7, torch.device("cpu")) is None
    slots.clear(3)
    assert slots.stacked.slots == (2, 4) and slots.stacked.widths["o_proj"] == 3


@pytest.mark.parametrize("f16", [False, True])
def test_a_gguf_lora_file_reads_as_its_peft_directory(tmp_path, loaded_smollm2, f16):
    """The same adapter as a PEFT directory and as the GGUF file llama.cpp's converter writes
    (B of q / k permuted for llama's rotary layout, alpha in the metadata): the same matrices
    (float16's rounding apart), so the same outputs."""
    from lora_files import write_gguf_lora

    from ferrobatch.model.lora_adapter import read_lora_adapter
    cfg = loaded_smollm2.config
    pairs = write_peft_adapter(str(tmp_path / "peft"), cfg, targets=ATTN + MLP, r=4, alpha=8,
                               layers=[0, 3])
    write_gguf_lora(str(tmp_path / "a.gguf"), cfg, pairs, 8, f16=f16)
    peft = read_lora_adapter(str(tmp_path / "peft"), cfg)
    gguf = read_lora_adapter(str(tmp_path / "a.gguf"), cfg)
    assert gguf.modules == peft.modules and gguf.rank == peft.rank == 4
    tol = dict(rtol=2e-3, atol=2e-4) if f16 else dict(rtol=1e-6, atol=1e-7)
    for layer in (0, 3):
        for module, w in peft.layers[layer].items():
            torch.testing.assert_close(gguf.layers[layer][module].a_t, w.a_t, **tol)
            torch.testing.assert_close(gguf.layers[layer][module].b_t, w.b_t, **tol)


def test_gguf_files_that_are_not_this_models_lora_are_refused(tmp_path, loaded_smollm2,
                                                              smollm2_gguf_path):
    from lora_files import write_gguf_lora

    from ferrobatch.model.lora_adapter import read_lora_adapter
    cfg = loaded_smollm2.config
    pairs = write_peft_adapter(str(tmp_path / "peft"), cfg, layers=[0])
    with pytest.raises(ValueError, match="not a GGUF LoRA adapter"):
        read_lora_adapter(smollm2_gguf_path, cfg)            # the model itself
    write_gguf_lora(str(tmp_path / "qwen.gguf"), cfg, pairs, 16, arch="qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2'"):
        read_lora_adapter(str(tmp_path / "qwen.gguf"), cfg)
    write_gguf_lora(str(tmp_path / "cvec.gguf"), cfg, pairs, 16, adapter_type="control_vector")
    with pytest.raises(ValueError, match="not a GGUF LoRA adapter"):
        read_lora_adapter(str(tmp_path / "cvec.gguf"), cfg)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_lora_adapter(str(tmp_path / "junk.gguf"), cfg)


def test_add_remove_and_list_loras_as_vllm(llm, adapters):
    qv, rs = adapters["qv"][0], adapters["rs"][0]
    assert llm.add_lora(qv) and qv.lora_int_id in llm.list_loras()
    assert llm.remove_lora(qv.lora_int_id) and qv.lora_int_id not in llm.list_loras()
    assert not llm.remove_lora(qv.lora_int_id)               # not loaded any more
    assert llm.add_lora(rs) and llm.add_lora(qv)
    assert {qv.lora_int_id, rs.lora_int_id} <= llm.list_loras()
    with pytest.raises(ValueError, match="does not exist"):
        llm.add_lora(LoRARequest("missing", 77, "/no/such/adapter"))
    llm.engine.loras.check()


def test_a_hub_id_resolves_to_its_snapshot(tmp_path, loaded_smollm2, monkeypatch):
    """`org/name` that is no local path is fetched as models are (the cached snapshot, else a
    download); a Hub that cannot provide it is a ValueError naming the id."""
    import huggingface_hub

    from ferrobatch.model.lora_adapter import read_lora_adapter
    cfg = loaded_smollm2.config
    write_peft_adapter(str(tmp_path / "snap"), cfg, layers=[0])
    asked = []

    def snapshot_download(repo_id, **kw):
        asked.append(repo_id)
        if repo_id != "someone/poet-lora":
            raise FileNotFoundError("404 Client Error: Repository Not Found")
        return str(tmp_path / "snap")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)                       # no local "someone/poet-lora" here
    adapter = read_lora_adapter("someone/poet-lora", cfg)
    assert adapter.path == str(tmp_path / "snap") and asked[0] == "someone/poet-lora"
    with pytest.raises(ValueError, match="'nobody/nothing'.*Hub could not provide it"):
        read_lora_adapter("nobody/nothing", cfg)


def test_the_gpu_reserve_covers_what_full_slots_hold(tmp_path, loaded_smollm2):
    """`reserve_bytes` (kept out of a GPU KV cache) equals what `max_loras` adapters of the
    largest rank on every projection take, each with its share of the stack, and with decode
    graphs the LoRA graphs' static weights besides."""
    from ferrobatch.model.lora_adapter import read_lora_adapter
    from ferrobatch.runtime.lora import LoraSlots, reserve_bytes
    from ferrobatch.runtime.lora_graphs import GraphLoraWeights
    cfg = loaded_smollm2.config
    slots = LoraSlots(cfg.num_layers, 2)
    for slot in (1, 2):
        write_peft_adapter(str(tmp_path / str(slot)), cfg, targets=ATTN + MLP, r=4, seed=slot)
        slots.put(slot, read_lora_adapter(str(tmp_path / str(slot)), cfg))
    held = sum(a.num_bytes for a in slots.adapters.values()) + sum(
        t.numel() * t.element_size() for layer in slots.stacked.layers
        for pair in layer.values() for t in pair)
    assert reserve_bytes(cfg, 2, 4, torch.float32) == held
    assert reserve_bytes(cfg, 2, 4, torch.float32, graphs=True) == \
        held + GraphLoraWeights(cfg, 2, 4, torch.float32, "cpu").num_bytes


def test_adapter_files_are_read_off_the_event_loop(llm, adapters, monkeypatch):
    """A request for an adapter not loaded has its files read on a worker thread (`prepare`,
    or in the background while it waits for a slot), never on the engine's event loop, where
    every stream would stall for the read."""
    import threading
    engine = llm.engine
    registry = engine.loras
    for request, _, _ in adapters.values():              # nothing loaded, nothing read ahead
        registry.evict(request.lora_int_id)
    reads = []
    read = registry._load

    def spy(request):
        reads.append(threading.current_thread() is llm._thread)
        return read(request)
    monkeypatch.setattr(registry, "_load", spy)
    # two slots for three adapters at once: the third waits, read in the background meanwhile
    names = ["qv", "all", "rs"]
    outs = _greedy(llm, [0, 1, 2], [adapters[n][0] for n in names])
    assert all(len(o) == NEW_TOKENS for o in outs)
    assert len(reads) >= 3 and not any(reads), reads
    llm._run(engine.check_idle_clean())


def test_loads_and_evictions_are_logged(tmp_path, loaded_smollm2, caplog):
    """Each adapter put into a slot, and each one evicted, is one INFO line saying which and
    why (what it adapts, its size, the model it says it was trained on)."""
    from ferrobatch.engine.lora_registry import LoraRegistry
    from ferrobatch.model.lora_adapter import read_lora_adapter
    from ferrobatch.runtime.lora import LoraSlots
    cfg = loaded_smollm2.config
    registry = LoraRegistry(LoraSlots(cfg.num_layers, 1),
                            lambda r: read_lora_adapter(r.lora_path, cfg))
    for k in (1, 2):
        write_peft_adapter(str(tmp_path / str(k)), cfg, layers=[0], seed=k, extra_config={
            "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    with caplog.at_level("INFO", logger="ferrobatch.engine.lora_registry"):
        registry.load(LoRARequest("one", 1, str(tmp_path / "1")))
        registry.load(LoRARequest("two", 2, str(tmp_path / "2")))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("LoRA adapter 'one' (id 1) in slot 1: rank 8 on qkv_proj")
    assert "trained on HuggingFaceTB/SmolLM2-135M-Instruct" in lines[0]
    assert lines[1] == "LoRA adapter 'one' (id 1) evicted from slot 1: idle, least recently used"
    assert lines[2].startswith("LoRA adapter 'two' (id 2) in slot 1")
