"""Tiny transformers models with random weights: the oracle of the loader and architecture tests
(ferrobatch loads what `save_pretrained` or a GGUF writer makes of them)."""

from __future__ import annotations

import copy

import pytest
import torch


def random_hf_model(config: dict, seed: int, std: float = 0.1):
    """transformers' model for a `config.json` dict, float32, every parameter ~ N(0, std)
    (norms included, so their weights matter), in eval mode. ``config`` is left as it was
    (transformers completes nested rope dicts in place)."""
    transformers = pytest.importorskip("transformers")
    config = copy.deepcopy(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return model


def assert_greedy_matches(loaded, reference, prompts: list[list[int]], new_tokens: int, *,
                          runner=None, execute=None, num_blocks: int = 64,
                          token_budget: int = 16) -> dict[int, list[int]]:
    """Greedy continuations of ``prompts`` through ferrobatch (``runner``, by default a
    ModelRunner of ``loaded`` with blocks of 4; prefill chunks of up to ``token_budget`` tokens,
    then decode steps; ``execute(batch)`` runs a step): every token is transformers'
    ``reference``'s argmax at its position on the whole sequence, and the last step's logits
    equal its logits within 1e-4. Returns the tokens of each prompt."""
    from step_builder import ToyScheduler, greedy_run

    from ferrobatch.runtime.model_runner import ModelRunner

    runner = runner or ModelRunner(loaded, num_blocks=num_blocks, block_size=4)
    sched = ToyScheduler(num_blocks, 4, token_budget=token_budget)
    for i, prompt in enumerate(prompts):
        sched.add(i, prompt, new_tokens)
    generated, last = greedy_run(runner, sched, execute=execute)
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            sequence = prompt + generated[i][:-1]
            want = reference(torch.tensor([sequence])).logits[0]
            assert want[len(prompt) - 1:].argmax(-1).tolist() == generated[i], i
            torch.testing.assert_close(last[i], want[-1], rtol=1e-4, atol=1e-4)
    return generated
