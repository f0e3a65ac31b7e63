"""EngineConfig: every engine knob, validated once, frozen afterwards.

The defaults are tuned for the CPU path (the embedded SmolLM2 on a laptop): a 1 GiB KV budget,
16-token blocks and a 512-token step budget keep inter-token latency low on two cores. On a GPU the
KV budget comes from `gpu_memory_utilization` unless `kv_cache_gb` or `num_blocks` is given, and
the step limits are 256 sequences and 8192 tokens unless `max_num_seqs` /
`max_num_batched_tokens` are given.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

POLICIES = ("fcfs", "priority")
# float16 / fp8 (FP8 E4M3, vLLM's name; fp8_e4m3 the same) / int8 (a scale per token and KV
# head, llama.cpp's q8_0 cache): CPU only, beside a float32 model
KV_CACHE_DTYPES = ("auto", "float32", "float16", "fp8", "fp8_e4m3", "int8")
# each kv_cache_dtype but auto -> the torch dtype the cache stores (`torch.<value>`)
KV_CACHE_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "fp8": "float8_e4m3fn",
                         "fp8_e4m3": "float8_e4m3fn", "int8": "int8"}
MAX_SPECULATIVE_TOKENS = 16     # also the longest n-gram (the Rust scheduler's limits)
# the dtype names `dtype` takes -> the torch dtype each one means (`torch.<value>`)
DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16",
          "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
ATTN_BACKENDS = ("auto", "torch", "cpu", "cuda")
MAX_BLOCK_SIZE = 1024
# the Rust scheduler's caps (config.rs), checked here too so that a bad value is refused before
# the model loads and the KV cache is allocated
INT32_MAX = (1 << 31) - 1
PIECEWISE_DEFAULT_MAX_TOKENS = 8192

CAPS = {"num_blocks": 1 << 22, "max_num_seqs": 1 << 16, "intake_capacity": 1 << 20,
        "max_num_batched_tokens": INT32_MAX, "max_model_len": INT32_MAX,
        "block_size": MAX_BLOCK_SIZE}
MAX_LORAS, MAX_LORA_RANK = 256, 1024


class Speculation(NamedTuple):
    """Prompt-lookup speculative decoding as the scheduler runs it (see the config fields)."""

    num_tokens: int         # drafts per sequence and step (0 = off)
    max_running: int        # draft only while at most this many sequences run (0 = any load)
    max_step_tokens: int    # drafts fill a step only up to this many tokens (0 = its budget)
    adaptive: bool = False  # a sequence drafts at most one past its last drafts' accepted count

    def describe(self) -> str:
        """The setting in words (startup log, serve banner)."""
        if not self.num_tokens:
            return "off"
        if not self.max_running:
            load = "at any load"
        elif self.max_running == 1:
            load = "while at most 1 sequence runs"
        else:
            load = f"while at most {self.max_running} sequences run"
        fill = (f", filling steps up to {self.max_step_tokens} tokens"
                if self.max_step_tokens else "")
        adapt = ", fewer after drafts the model cut short" if self.adaptive else ""
        return f"prompt lookup, up to {self.num_tokens} drafts per step {load}{fill}{adapt}"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine (model, KV cache, scheduler, admission limits)."""

    model: str = "smollm2"
    device: str = "auto"                 # "auto" -> cuda when available, else cpu
    dtype: str | None = None             # None (or "auto") -> the runtime's default for the device
    attn_backend: str | None = None      # auto | torch | cpu | cuda; None = auto (cuda / cpu kernels)
    cuda_graphs: bool = True             # CUDA: replay captured decode steps (False = eager only)
    piecewise_max_tokens: int | None = None   # CUDA: other steps (prefill, mixed) of up to this
                                         # many tokens replay the model between attention calls
                                         # (None -> the step budget, at most 8192; 0 = off)
    flash_prefill: bool = True           # CUDA, bf16/fp16: prefill attention on torch's
                                         # FlashAttention-2 (after a start-up check against
                                         # ferrobatch's prefill kernel; False = that kernel)
    gguf_blocks: bool = True             # CPU, GGUF model: linears loaded as their blocks
                                         # (never float32) and read by the block kernels
    amx_tiles: bool = True               # CPU with AMX: GGUF blocks as AMX tiles (steps of 5+ rows),
                                         # long prompt chunks' attention on AMX
    fused_decode: bool = True            # CPU: steps run every layer in one Rust call

    # KV cache
    block_size: int = 16
    kv_cache_gb: float | None = None     # None -> 1 GiB on CPU, gpu_memory_utilization on GPU
    kv_cache_dtype: str = "auto"         # auto (the model's dtype) | float16 | fp8 | int8 (CPU,
                                         # float32 model: a half / a quarter (int8: plus a scale
                                         # per head) of the bytes per token, not token-identical)
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None        # explicit override of the KV sizing (tests, benchmarks)
    enable_prefix_caching: bool = True

    # Scheduler
    max_num_seqs: int | None = None      # None -> 128 on CPU, 256 on CUDA (sequences per step)
    max_num_batched_tokens: int | None = None   # None -> 512 on CPU, 8192 on CUDA (per step)
    max_model_len: int | None = None     # None -> min(model context, 8192)
    scheduling_policy: str = "fcfs"      # "fcfs" or "priority" (lower value runs first)
    max_preemptions: int = 8
    seed: int | None = None              # seeds the sampling of requests without their own seed
                                         # (None: a random start); as vLLM's, it makes a run
                                         # repeatable only with the same requests in the same
                                         # steps (a request's own seed: whatever runs beside it)
    intake_capacity: int = 4096
    admission_batch: int = 1             # while sequences run, waiting ones join only once this
                                         # many (all that wait, if fewer) find free slots: one
                                         # refill's prefill serves several (1 = at once)
    admission_max_wait_steps: int = 8    # ... or after this many held steps in a row

    # Speculative decoding by prompt lookup (greedy requests; README "Speculative decoding")
    num_speculative_tokens: int | None = None   # drafts per step and sequence (0 = off, <= 16);
                                                # None -> 3 on CPU, 0 on CUDA (not measured there)
    speculative_ngram_min: int = 2       # shortest / longest n-gram matched in the sequence
    speculative_ngram_max: int = 4
    speculative_max_running: int | None = None  # draft only while at most this many sequences
                                                # run (0 = any load); None -> 0 on CPU, 8 on CUDA
    speculative_max_step_tokens: int | None = None  # drafts fill a step only up to this many
                                                # tokens (0 = the step budget); None -> 8 on
                                                # CPU, 0 on CUDA
    speculative_adaptive: bool = True    # after drafts cut short at a accepted tokens, a
                                         # sequence drafts at most a + 1 next (K again after
                                         # drafts accepted in full); False: always K

    # Admission limits (validated before anything is allocated)
    max_queued_requests: int = 1024      # accepted but not yet scheduled; beyond -> QueueFullError
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300
    chat_template: str | None = None     # Jinja text replacing the model's chat template
    tokenizer: str | None = None         # vLLM's --tokenizer: a HF directory, Hub id or .gguf
    #                                      whose tokenizer (and chat template) replaces the model's
    cpu_threads: int | None = None       # CPU: the kernels' threads (None: torch's count, the
    #                                      cores or OMP_NUM_THREADS); sets torch's, process-wide

    # LoRA adapters (README "LoRA adapters"): requests name one (LoRARequest / the `model` field)
    enable_lora: bool = False
    max_loras: int = 4                   # adapters loaded at once (each in a slot; the least
                                         # recently used idle one makes room for another)
    max_lora_rank: int = 16              # adapters of a higher rank are refused (as vLLM;
                                         # on a GPU the KV cache leaves room for max_loras of it)

    # engine-wide logits processor factories: callables, classes or import paths
    # ("package.module:name"); each gives a request its processor or None
    # (runtime/logits_processors.py; vLLM's --logits-processors)
    logits_processors: tuple[Any, ...] = ()

    # the sampling defaults of requests that leave a field unset (model/generation_defaults.py):
    # "auto" (the model's generation_config.json / GGUF general.sampling.*), "vllm" (the
    # built-in ones) or a directory with a generation_config.json; override sets fields on top
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string")
        if self.chat_template is not None:
            if not isinstance(self.chat_template, str) or not self.chat_template.strip():
                raise ValueError("chat_template must be a non-empty Jinja text")
            from ferrobatch.model.chat_template import compile_chat_template
            compile_chat_template(self.chat_template)    # a syntax error fails before loading
        if self.dtype == "auto":                 # vLLM's name for the default
            object.__setattr__(self, "dtype", None)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2^63) or None, got {self.seed!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "cpu_threads"):
            if getattr(self, name) is not None:
                positive_int(name)
        for name in ("block_size", "intake_capacity", "admission_batch",
                     "max_queued_requests", "max_n", "max_stop_strings", "max_stop_string_len",
                     "max_stop_token_ids", "max_logit_bias", "max_loras", "max_lora_rank"):
            positive_int(name)
        for name in ("cuda_graphs", "flash_prefill", "gguf_blocks", "amx_tiles", "fused_decode",
                     "speculative_adaptive", "enable_prefix_caching", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if isinstance(self.max_preemptions, bool) or not isinstance(self.max_preemptions, int) \
                or self.max_preemptions < 0:
            raise ValueError(f"max_preemptions must be an integer >= 0, got {self.max_preemptions!r}")
        for name in ("num_speculative_tokens", "speculative_max_running",
                     "speculative_max_step_tokens", "piecewise_max_tokens",
                     "admission_max_wait_steps"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.admission_max_wait_steps > 1 << 20:
            raise ValueError(f"admission_max_wait_steps must be <= {1 << 20}, got "
                             f"{self.admission_max_wait_steps}")
        if self.admission_batch > 1 << 16:
            raise ValueError(f"admission_batch must be <= {1 << 16}, got {self.admission_batch}")
        if (self.num_speculative_tokens or 0) > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got "
                             f"{self.num_speculative_tokens}")
        lo, hi = self.speculative_ngram_min, self.speculative_ngram_max
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (lo, hi)) \
                or not 1 <= lo <= hi <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative n-gram lengths must satisfy 1 <= "
                             f"speculative_ngram_min <= speculative_ngram_max <= "
                             f"{MAX_SPECULATIVE_TOKENS}, got {lo!r} and {hi!r}")
        if self.num_blocks is not None:
            positive_int("num_blocks")
            if self.num_blocks < 2:
                raise ValueError("num_blocks must be >= 2 (block 0 is the reserved null block)")
        if self.max_model_len is not None:
            positive_int("max_model_len")
        for name, cap in (*CAPS.items(), ("max_loras", MAX_LORAS),
                          ("max_lora_rank", MAX_LORA_RANK)):
            v = getattr(self, name)
            if v is not None and v > cap:
                raise ValueError(f"{name} must be <= {cap}, got {v}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attn_backend is not None and self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {', '.join(ATTN_BACKENDS)}, got "
                             f"{self.attn_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.kv_cache_gb is not None and not (
                _is_number(self.kv_cache_gb) and math.isfinite(self.kv_cache_gb)
                and self.kv_cache_gb > 0):
            raise ValueError(f"kv_cache_gb must be a positive number, got {self.kv_cache_gb!r}")
        if not _is_number(self.gpu_memory_utilization) or \
                not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        entries = self.logits_processors
        if not isinstance(entries, (tuple, list)) or not all(
                isinstance(e, str) or callable(e) for e in entries):
            raise ValueError("logits_processors must be a list of import paths "
                             "('package.module:name') or callables")
        object.__setattr__(self, "logits_processors", tuple(entries))
        if entries:
            from ferrobatch.runtime.logits_processors import resolve_factories
            resolve_factories(entries)           # an import error fails before loading
        from ferrobatch.model.generation_defaults import check_setting
        check_setting(self.generation_config, self.override_generation_config)
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got "
                             f"{self.scheduling_policy!r}")

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from keyword options, rejecting unknown names with a clear message."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(known))}")
        return cls(**options)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def resolved_device(self) -> str:
        """The torch device to run on; ValueError for a CUDA device this machine lacks (said
        before the model is loaded, not after)."""
        import torch
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: CUDA is not available on this machine "
                                 "(use --device cpu or auto)")
            index = int(self.device[5:] or 0) if self.device != "cuda" else 0
            if index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r}: this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s)")
        return self.device

    def step_seq_limit(self, device_type: str) -> int:
        """Sequences per step: ``max_num_seqs``, or 128 on the CPU / 256 on a GPU when unset."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return 256 if device_type == "cuda" else 128

    def step_token_budget(self, device_type: str) -> int:
        """Tokens per step: ``max_num_batched_tokens``, or the device's default when unset (512
        on the CPU keeps inter-token latency low on a few cores; 8192 on a GPU lets prefill
        chunks fill it)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device_type == "cuda" else 512

    def piecewise_token_limit(self, device_type: str) -> int:
        """Largest step the piecewise CUDA graphs serve (0: none): ``piecewise_max_tokens``
        within the step budget, on CUDA with ``cuda_graphs``. By default the budget up to 8192
        tokens: on the H200 even an 8192-token prefill of SmolLM2-135M cost more in launches
        than on the GPU, while a larger budget would mean many more buckets (one per 512
        tokens) for steps whose GPU work hides their launches."""
        if device_type != "cuda" or not self.cuda_graphs:
            return 0
        budget = self.step_token_budget(device_type)
        return min(budget, PIECEWISE_DEFAULT_MAX_TOKENS if self.piecewise_max_tokens is None
                   else self.piecewise_max_tokens)

    def speculation(self, device_type: str) -> Speculation:
        """The prompt-lookup setting on this device, defaults filled in. On the CPU drafts run
        at any load but fill a step only up to 8 tokens (3 drafts each for up to 2 running
        sequences, fewer shared among up to 7). Chosen (session 10) when steps of at most 8 rows
        read the GGUF blocks (``cpu_linear.QUANT_MAX_ROWS``) and larger ones the float32 panels;
        side by side this beat both drafting only while one sequence runs and filling steps up
        to 16 tokens (benches/speculative.py, README Results). Steps of a few rows now read the
        blocks, their quantized panels or AMX tiles: a 4-row step's linear layers cost 1.5x a
        one-row step's on an AVX2 Zen 3, an 8-row step's 2.4x (session 20, after the one-row
        step got faster; the default still won there: README Results). On CUDA it
        is off unless asked for: not measured there yet."""
        cuda = device_type == "cuda"
        k, running, step = (self.num_speculative_tokens, self.speculative_max_running,
                            self.speculative_max_step_tokens)
        return Speculation(num_tokens=k if k is not None else (0 if cuda else 3),
                           max_running=running if running is not None else (8 if cuda else 0),
                           max_step_tokens=step if step is not None else (0 if cuda else 8),
                           adaptive=self.speculative_adaptive)

    def kv_budget_bytes_cpu(self) -> int:
        """KV cache bytes to allocate on CPU (1 GiB unless `kv_cache_gb` says otherwise)."""
        return int((self.kv_cache_gb if self.kv_cache_gb is not None else 1.0) * (1 << 30))
