"""Typed stub of the native module `ferrobatch._scheduler` (rust_scheduler/src/py.rs).

Contract of the step arrays: README.md, "The step, in arrays".
"""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

class QueueFullError(RuntimeError):
    """The bounded intake queue is full; retry later (HTTP 429)."""

class Intake:
    """Thread-safe submit/abort handle (cheap to share; usable from any thread)."""

    def submit(
        self,
        request_id: int,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.int32] | npt.NDArray[np.int64],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] | None = None,
        n: int = 1,
        priority: int = 0,
        cache_salt: str | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        speculate: bool = False,
    ) -> None:
        """Validate and enqueue; never blocks. Raises ValueError (bad input, can never fit,
        duplicate live id) or QueueFullError. `speculate=True` lets prompt lookup draft this
        request's tokens (the caller vouches that each row's token is drawn from that row's
        own distribution, with no per-token state kept outside; ignored when n > 1)."""
    def abort(self, request_id: int, seq_index: int = -1, reason: str = "abort") -> None:
        """Abort one sequence or all (-1). reason: "abort" (3), "stop" (1) or "error" (4).
        Unknown / finished ids are ignored. Raises QueueFullError if the queue is full."""
    def wait_for_work(self, timeout_s: float | None = None) -> bool:
        """Block (GIL released) until a command is queued (True), notify() or timeout (False)."""
    def notify(self) -> None:
        """Wake waiters (shutdown)."""
    def __len__(self) -> int:
        """Commands queued and not yet drained."""

class StepBatch:
    input_ids: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int32]
    slot_mapping: npt.NDArray[np.int32]
    query_start_loc: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    block_tables: npt.NDArray[np.int32]  # [B, max_blocks_per_seq], padded with 0
    block_copies: npt.NDArray[np.int32]  # [C, 2] (src, dst)
    seq_req_ids: npt.NDArray[np.uint64]
    seq_indices: npt.NDArray[np.int32]
    logits_indices: npt.NDArray[np.int32]
    sample_req_ids: npt.NDArray[np.uint64]
    sample_seq_indices: npt.NDArray[np.int32]
    sample_output_lens: npt.NDArray[np.int32]
    temperature: npt.NDArray[np.float32]
    top_k: npt.NDArray[np.int32]
    top_p: npt.NDArray[np.float32]
    min_p: npt.NDArray[np.float32]
    repetition_penalty: npt.NDArray[np.float32]
    presence_penalty: npt.NDArray[np.float32]
    frequency_penalty: npt.NDArray[np.float32]
    seed: npt.NDArray[np.int64]
    suppress_eos: npt.NDArray[np.uint8]
    num_tokens: int
    num_seqs: int
    num_samples: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_draft_tokens: int  # speculative drafts: a drafted sequence has 1 + drafts rows sampled
    max_blocks_per_seq: int

class StepOutput:
    req_ids: npt.NDArray[np.uint64]
    seq_indices: npt.NDArray[np.int32]
    token_ids: npt.NDArray[np.int32]  # -1: no token
    finish_reasons: npt.NDArray[np.uint8]  # 0 running, 1 stop, 2 length, 3 abort, 4 error
    error_messages: dict[int, str]
    num_events: int
    def __len__(self) -> int: ...

class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 8192,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] | None = None,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        max_preemptions: int = 8,
        intake_capacity: int = 4096,
        long_prefill_token_threshold: int = 0,
        num_speculative_tokens: int = 0,
        speculative_ngram_min: int = 2,
        speculative_ngram_max: int = 4,
        speculative_max_running: int = 0,
        speculative_max_step_tokens: int = 0,
        speculative_adaptive: bool = False,
        admission_batch: int = 1,
        admission_max_wait_steps: int = 8,
    ) -> None: ...
    def intake(self) -> Intake: ...
    def schedule(self) -> StepBatch:
        """Drain the intake and build the next step (GIL released). ValueError if the previous
        step's update() is missing."""
    def update(self, sampled: npt.NDArray[np.int32] | npt.NDArray[np.int64] | Sequence[int]) -> StepOutput:
        """Apply one sampled token per logits row of the last batch; ValueError on a length
        mismatch or out-of-range token (nothing changes then)."""
    def has_unfinished(self) -> bool: ...
    def stats(self) -> dict[str, int | float]: ...
    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (used ones stay shared); returns how many."""
    def check_integrity(self) -> None:
        """Raise RuntimeError describing a broken invariant."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> list[int]: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def policy(self) -> str: ...

def paged_decode_attention_f32(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    ctx_lens: np.ndarray,
    out: np.ndarray,
    scale: float,
    num_threads: int,
) -> None:
    """Decode attention over the paged cache, written into ``out`` (GIL released).

    q / out ``[S, Hq, D]`` float32, caches ``[num_blocks, block_size, Hkv, D]`` float32,
    float16 or uint8 (FP8 E4M3 bytes: torch's float8_e4m3fn viewed as uint8), or ``[...,
    D + 4]`` int8 (each head row's values then its float32 scale's bytes) (both alike;
    computed in float32), block_tables ``[S, max_blocks]`` / ctx_lens
    ``[S]`` int32, all C-contiguous. ValueError for any shape or block id that would read
    outside the arrays (checked before reading).
    """

def paged_prefill_attention_f32(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    q_starts: np.ndarray,
    q_lens: np.ndarray,
    seq_lens: np.ndarray,
    out: np.ndarray,
    scale: float,
    num_threads: int,
    amx: bool = True,
) -> None:
    """Causal attention of prompt chunks over the paged cache, into ``out`` (GIL released).
    Calls whose chunks average at least 128 queries per key run on Intel AMX where the CPU has
    it and ``amx`` (three bfloat16 parts per float32: float32 accuracy; cpu_amx_prefill.rs).

    q / out ``[T, Hq, D]`` float32 (the step's rows), caches ``[num_blocks, block_size, Hkv,
    D]`` float32, float16 or uint8 (FP8 E4M3 bytes), or ``[..., D + 4]`` int8 (both alike); per chunk ``s`` (int32): its first row
    ``q_starts[s]``, ``q_lens[s]`` queries, ``seq_lens[s]`` keys (context included, the chunk's own K/V already in the cache) and
    ``block_tables[s]`` (``[P, max_blocks]``). Query ``j`` sees keys
    ``0 ..= seq_lens[s] - q_lens[s] + j``. Chunks' rows must be ascending and disjoint; rows of
    no chunk are left untouched. ValueError, nothing written, on any bad input.
    """

def linear_f32(
    x: np.ndarray,
    packed: np.ndarray,
    bias: np.ndarray | None,
    out: np.ndarray,
    num_threads: int,
) -> None:
    """``out[M, N] = x[M, K] @ W.T + bias`` into ``out`` (GIL released), float32, C-contiguous.

    ``packed`` is ``W`` as ``[ceil(N / 16), K, 16]`` (panel ``p``, row ``k`` holds
    ``W[16p:16p+16, k]``, zeros past N); ``bias`` ``[N]`` or None. ValueError on any shape mismatch.
    """

def linear_q4_1_f32(
    x: np.ndarray,
    scale: np.ndarray,
    min: np.ndarray,
    qs: np.ndarray,
    bias: np.ndarray | None,
    out: np.ndarray,
    num_threads: int,
) -> None:
    """``out[M, N] = x[M, K] @ W.T + bias`` with ``W`` in GGUF Q4_1 blocks (GIL released), M <= 4.

    ``scale`` / ``min`` ``[N, K / 32]`` float32, ``qs`` ``[N, K / 32, 16]`` uint8 (byte j: element j
    in the low nibble, j + 16 in the high); ``w = scale * q + min``. ValueError on any mismatch.
    """

def linear_q8_0_f32(
    x: np.ndarray,
    scale: np.ndarray,
    qs: np.ndarray,
    bias: np.ndarray | None,
    out: np.ndarray,
    num_threads: int,
) -> None:
    """The same with ``W`` in GGUF Q8_0 blocks: ``scale`` ``[N, K / 32]`` float32, ``qs``
    ``[N, K / 32, 32]`` int8; ``w = scale * q``."""

def amx_available() -> bool:
    """Whether ``linear_amx_f32`` runs here: AMX-TILE, AMX-BF16 and AVX-512F, the tile state
    granted by Linux, and ``FERROBATCH_CPU_ISA`` unset or ``amx``."""

def pack_amx_q4_1(scale: np.ndarray, min: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (the arrays ``linear_q4_1_f32`` reads) as the AMX kernel's tiles: uint16
    ``[ceil(N / 16) * K / 32 * 576]`` (layout: ``rust_scheduler/src/cpu_amx_linear.rs``). Best
    copied to a 64-byte-aligned array (``cpu_linear._aligned_64``)."""

def pack_amx_q8_0(scale: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The same for Q8_0 blocks (``qs`` ``[N, K / 32, 32]`` int8)."""

def linear_amx_f32(
    x: np.ndarray,
    tiles: np.ndarray,
    kind: str,
    bias: np.ndarray | None,
    out: np.ndarray,
    num_threads: int,
) -> None:
    """``out[M, N] = x[M, K] @ W.T + bias`` with ``W`` packed by ``pack_amx_q4_1`` (``kind``
    "q4_1") / ``pack_amx_q8_0`` ("q8_0") (GIL released), any M: bfloat16 tile products of the
    blocks' integers and ``x`` split exactly into three bfloat16 parts, so float32 accuracy.
    ValueError on any mismatch, or where AMX is not available."""

def pack_quant_panels_q4_1(scale: np.ndarray, min: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (the arrays ``linear_q4_1_f32`` reads) laid out as 16-feature panels for
    ``linear_quant_panels_f32``: uint8 ``[ceil(N / 16) * K / 32 * 384]`` (per panel and block of
    32 inputs: 16 scales, 16 mins, 16 x 16 nibble bytes; ``cpu_quant_panels.rs``)."""

def pack_quant_panels_q8_0(scale: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The same for Q8_0 blocks (``qs`` ``[N, K / 32, 32]`` int8): 576 bytes per 16 features x
    32 inputs (16 scales, 32 x 16 int8)."""

def linear_quant_panels_f32(
    x: np.ndarray,
    panels: np.ndarray,
    kind: str,
    bias: np.ndarray | None,
    out: np.ndarray,
    num_threads: int,
) -> None:
    """``out[M, N] = x[M, K] @ W.T + bias`` with ``W`` packed by ``pack_quant_panels_q4_1``
    (``kind`` "q4_1") / ``pack_quant_panels_q8_0`` ("q8_0") / ``pack_quant_panels_q8_g16``
    ("q8_g16", "q8_s16") / ``pack_half_panels`` ("bf16", "f16") (GIL released), any M: each
    chunk of the panels unpacked to the loader's float32 weights, then ``linear_f32``'s tiles,
    so the output is bit for bit ``linear_f32``'s over those weights. ValueError on any
    mismatch."""

def pack_half_panels(weight: np.ndarray) -> tuple[str, np.ndarray] | None:
    """A float32 ``[N, K]`` weight whose every value bfloat16 (else float16) holds exactly as
    ``(kind, panels)``: ``kind`` "bf16" / "f16", ``panels`` uint8 ``ceil(N / 16) * K / 32 *
    1024`` on a 64-byte boundary for ``linear_quant_panels_f32`` (half the float32 panels'
    bytes, the same output bit for bit); None where neither holds every value or ``K`` is not
    a multiple of 32."""

def rms_norm_f32(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """Each row of ``x`` ``[M, H]`` over its root mean square (+ eps) times ``weight`` ``[H]``,
    into ``out`` ``[M, H]`` (GIL released). float32, C-contiguous; ValueError on a shape mismatch."""

def greedy_rows_f32(logits: np.ndarray, out: np.ndarray, num_threads: int) -> None:
    """Greedy sampling's read of ``logits`` ``[S, V]`` (float32, C-contiguous), one pass per row
    on the kernels' threads: ``out[r] = (index of row r's first largest value, 1 if every value
    of it is finite else 0)`` into ``out`` (int64 ``[S, 2]``); a row's index is meaningless
    where its flag is 0. ValueError on a shape mismatch."""

def sample_rows_f32(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    uniform: np.ndarray,
    out: np.ndarray,
    num_threads: int,
) -> None:
    """Random sampling's draw on the CPU (GIL released), rows over the kernels' threads: for each
    row ``r`` of ``logits`` ``[S, V]`` (float32, C-contiguous), ``out[r]`` (int64 ``[S]``) = the
    token drawn at ``uniform[r]`` (float64 in [0, 1)) from the softmax of ``logits[r] /
    temperature[r]`` (float32) cut to ``top_k[r]`` (int32, 0: all), then ``top_p[r]`` (float32 in
    (0, 1]), then ``min_p[r]`` (float32 in [0, 1]): the first token in index order at which the
    kept probabilities' running sum reaches ``1 - uniform[r]`` (``Sampler._draw``'s rule). A
    row with ``temperature <= 0`` gets its argmax; logits of -inf or NaN are never drawn.
    ValueError on a shape mismatch or a parameter out of range."""

def apply_penalties_f32(
    logits: np.ndarray,
    repetition: np.ndarray,
    frequency: np.ndarray,
    presence: np.ndarray,
    tokens: np.ndarray,
    spans: np.ndarray,
    num_threads: int,
) -> None:
    """The sampler's penalties on the CPU, in place (GIL released), rows over the kernels'
    threads: on each row ``r`` of ``logits`` ``[S, V]`` (float32, C-contiguous), ``repetition[r]``
    (float32; 1: none) once per distinct token of ``tokens[spans[r, 0]:spans[r, 1]]`` (prompt and
    output: ``x / r`` where ``x > 0``, else ``x * r``, clamped to the finite range), then
    ``frequency[r]`` and ``presence[r]`` per distinct token of ``tokens[spans[r, 2]:spans[r,
    3]]`` (output: ``x - f * count - p``); ``tokens`` int64, ``spans`` int64 ``[S, 4]``. The
    torch sampler's values bit for bit. ValueError on a shape mismatch or a token id outside the
    vocabulary (before any logit changes)."""

def logprobs_rows_f32(
    logits: np.ndarray,
    tokens: np.ndarray,
    chosen: np.ndarray,
    top_ids: np.ndarray,
    top_values: np.ndarray,
    num_threads: int,
) -> None:
    """Logprobs on the CPU (GIL released), rows over the kernels' threads: per row ``r`` of
    ``logits`` ``[S, V]`` (float32, C-contiguous), ``chosen[r]`` (float32 ``[S]``) = the
    ``log_softmax`` of token ``tokens[r]`` (int64 ``[S]``), and ``top_ids[r]`` (int64 ``[S, n]``)
    / ``top_values[r]`` (float32 ``[S, n]``) the ``n`` most likely tokens and their logprobs,
    descending, equal logits by lower id (a row with fewer than ``n`` logits above -inf fills up
    with its -inf ones). ValueError on a shape mismatch, a token outside the vocabulary or
    ``n`` above it."""

def linear_isa() -> str:
    """The instruction set of the linear kernels on this CPU: ``"avx512"``, ``"avx2"`` or
    ``"portable"`` (at most what ``FERROBATCH_CPU_ISA`` allows)."""

def one_row_int16_available() -> bool:
    """Whether one row of x against GGUF Q4_1 blocks takes the int16 dot-product kernel here
    (AVX-512 VNNI; at most what ``FERROBATCH_CPU_ISA`` allows)."""

def quant_panels_min_rows() -> int:
    """The fewest rows of a step that read a GGUF layer's quantized panels rather than its
    blocks on this CPU (no AMX): 4 on AVX2, 6 elsewhere."""

def rotary_f32(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate-half RoPE of ``x`` ``[T, heads, D]`` in place with ``cos`` / ``sin`` ``[T, D]``
    (GIL released), float32, C-contiguous; ValueError on a shape mismatch or odd D."""

class CpuDecoderStack:
    """A Llama-family model's decoder layers for fused CPU decode steps (``runtime.cpu_decoder``;
    source ``rust_scheduler/src/cpu_decoder.rs``). ``layers[i]`` is ``(input_norm, qkv, o_proj,
    post_norm, gate_up, down)``: norms float32 ``[hidden]``, each linear ``(n, k, panels, bias |
    None, blocks | None[, tiles | None])`` (``tiles`` as ``linear_amx_f32`` reads them, for steps
    of > 8 rows where AMX is available), ``panels`` as ``linear_f32`` reads them, ``blocks`` ``("q4_1", scale,
    min, qs)`` or ``("q8_0", scale, qs)`` as ``linear_q*_f32`` read them. The arrays are
    referenced, not copied, and viewed once, here: they must not be written (or resized) while
    the stack lives. ValueError on any shape mismatch."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float, layers: list[tuple]) -> None: ...
    @property
    def num_layers(self) -> int: ...
    def forward(self, hidden: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                caches: list[np.ndarray], slots: np.ndarray, block_tables: np.ndarray,
                ctx_lens: np.ndarray, num_threads: int, decode_rows: np.ndarray | None = None,
                prefill: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
                amx: bool = True, lora: tuple[CpuLoraStack, np.ndarray] | None = None) -> None:
        """Runs the step's ``R`` rows through every layer (GIL released): ``hidden`` ``[R, H]``
        in place (embeddings in, the last layer's output out), ``cos`` / ``sin`` ``[R, D]``, one
        ``[2, num_blocks, block_size, Hkv, D]`` cache per layer, all float32, all float16, all uint8 (FP8 E4M3 bytes) or all int8 (``[..., D + 4]``) (row
        ``r``'s K/V written at ``slots[r]``, int64, rounded to the cache's dtype). The decode
        kernel attends rows ``decode_rows`` (int64 ``[N]``;
        None: every row, N = R), the i-th its first ``ctx_lens[i]`` positions of
        ``block_tables[i]`` (int32 ``[N, max_blocks]`` / ``[N]``); the prefill kernel attends
        each chunk of ``prefill = (q_starts, q_lens, seq_lens, block_tables)`` (int32, as in
        ``paged_prefill_attention_f32``, with ``amx``). Every row must be attended exactly once.
        With ``lora = (stack, row_blocks)`` (int32 ``[R]``: each row's block of the stack, -1 for
        base-model rows) each linear layer's output gets the adapter rows' updates. ValueError,
        nothing written, on any bad input."""

class CpuLoraStack:
    """An engine's stacked LoRA adapters for fused CPU steps (``runtime.lora.StackedLora.
    cpu_stack``; source ``rust_scheduler/src/cpu_lora.rs``). ``layers[i]`` holds four entries
    (qkv, o_proj, gate_up, down), each None or ``(a, b_t, width, b_cols)``: float32 ``a``
    ``[blocks * width, k]``, ``b_t`` ``[blocks * width, n]`` and int32 ``b_cols``
    ``[blocks * width, 2]`` (each row of ``b_t``'s nonzero columns ``lo..hi``). Referenced, not
    copied: they must not be written while the stack lives; their shapes are checked against
    the model on every step that uses them."""

    def __init__(self, layers: list[list[tuple | None]]) -> None: ...

def set_decoder_phase_timing(on: bool) -> None:
    """Switches the fused step's phase accounting on or off (``cpu_step_timing.rs``; off by
    default, and then free): wall time of the linear layers, attention and the rest."""

def take_decoder_phase_times() -> dict[str, int]:
    """The fused steps' totals since the last call, then zeroed: ``linear_ns``,
    ``attention_ns``, ``other_ns``, ``steps``."""

class TokenVocab:
    """The model's vocabulary as a byte trie (built once, shared by every grammar)."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int) -> None:
        """``token_bytes[i]``: token i's bytes (``b""`` for a special token, never allowed);
        ids from ``len(token_bytes)`` up to ``vocab_size`` are padding, never allowed."""
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...

class GuidedGrammar:
    """One regex compiled into a byte-level DFA over a vocabulary; thread-safe, shared."""

    def __init__(self, pattern: str, vocab: TokenVocab, eos_token_ids: list[int],
                 size_limit_bytes: int = ...) -> None:
        """Rust regex syntax; only full matches can be generated. ValueError on a bad pattern,
        an automaton over ``size_limit_bytes`` (64 MiB by default) or a bad EOS id."""
    def start(self) -> GuidedSequence: ...
    def matches(self, text: str | bytes) -> bool: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def dfa_memory_bytes(self) -> int: ...
    @property
    def num_cached_states(self) -> int: ...

class GuidedSequence:
    """One sequence's position in a grammar."""

    def advance(self, token_id: int) -> bool:
        """Move past ``token_id``; False (and no move) when the grammar does not allow it."""
    def write_mask(self, mask: np.ndarray) -> int:
        """Write the allowed-token mask into ``mask`` (bool ``[vocab_size]``); returns the count."""
    def allowed_token_ids(self) -> list[int]: ...
    def copy(self) -> GuidedSequence: ...
    @property
    def num_allowed(self) -> int: ...
    @property
    def is_accepting(self) -> bool: ...
    @property
    def is_finished(self) -> bool: ...
    @property
    def vocab_size(self) -> int: ...
