#!/usr/bin/env bash
# The CPU measurements of README "Results", one command each, as run on 2026-11-30 (session 3
# ran 3, 4, 1, then 3 again and 5 after the RoPE kernel; session 4 ran 2 after the engine's
# hand-off cuts, then 6, 7, 1, 5 (with fresh prompts per run) and 8; session 6 ran 9, 11, 10 and 12). Run from the repository root on an otherwise idle machine; every
# table records the 1-minute load average before each system.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=benches/results/cpu
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# 1. Online serving over HTTP, Poisson arrivals: ferrobatch serve vs transformers' CB server
#    (session 4: 32 prompts per rate, fresh prompts per rate, up to "all at once").
$PY benches/serving.py --servers ferrobatch,hf --workload cpu-serve --num-prompts 32 \
  --request-rates 0.4,0.8,1.6,inf --json $OUT/serving_cpu-serve_long.json

# 2. Engine overhead (stub model) and the one-layer comparison with transformers' CB.
$PY benches/engine_overhead.py --running 64,256,1024 --l1 16 --l2 48 \
  --json $OUT/engine_overhead.json

# 3. Offline throughput: all systems in one run; hf-static at three batch sizes (the sweep);
#    ferrobatch@32 vs ferrobatch-static@32 is a control (cap >= requests: the same schedule).
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,hf-static@16,hf-continuous,hf-static@8,hf-static@32,ferrobatch@32,ferrobatch-static@32 \
  --json $OUT/throughput_cpu-small.json

# 4. The CPU kernels against what they replace (Rust decode attention vs the torch reference,
#    Rust linear kernel vs oneDNN-prepacked vs F.linear), SmolLM2 shapes.
$PY benches/cpu_kernels.py --json $OUT/cpu_kernels.json

# 5. The same serving workload through ferrobatch's three doors (OpenAI HTTP, WebSocket,
#    msgpack/TCP) at 0.8 req/s, one door after another.
$PY benches/serving.py --servers ferrobatch --doors http,ws,tcp --workload cpu-serve --num-prompts 16 \
  --request-rates 0.8 --json $OUT/serving_cpu-serve_doors.json

# 6. The four headline systems of 3 again, after session 4's engine changes (a shorter rerun).
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,hf-static@16,hf-continuous \
  --json $OUT/throughput_cpu-small_rerun.json

# 7. Time to first token of one long prompt (512-token prefill chunks), and its attention share.
$PY benches/prefill_latency.py --lengths 256,1024,2048

# 8. The chat-like length mix (log-normal prompts and answers, long tail), same four systems.
$PY benches/throughput.py --workload cpu-chat \
  --systems ferrobatch,ferrobatch-static,hf-static@16,hf-continuous \
  --json $OUT/throughput_cpu-chat.json

# 9. The static ablation across caps 4 / 8 / 16 (session 6): measured ratio next to the bound
#    the schedule alone sets (ideal static / continuous decode steps), printed and in the JSON.
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch@4,ferrobatch-static@4,ferrobatch@8,ferrobatch-static@8,ferrobatch,ferrobatch-static \
  --json $OUT/throughput_cpu-small_capsweep.json

# 10. Decode steps with and without the GGUF block kernel (session 6), side by side.
$PY benches/model_forward.py --model smollm2 --compare-gguf-blocks --iters 7

# 11. The same as served: ferrobatch vs ferrobatch --no-gguf-blocks at a low and a higher rate.
$PY benches/serving.py --servers ferrobatch,ferrobatch-f32 --workload cpu-serve --num-prompts 24 \
  --request-rates 0.4,1.6 --json $OUT/serving_cpu-serve_gguf_blocks.json

# 12. The four headline systems of 3 again (session 6, after logprobs and the block kernel).
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,hf-static@16,hf-continuous \
  --json $OUT/throughput_cpu-small_session6.json

# 13. Guided decoding (session 7): a JSON Schema's cost against the same tokens unguided.
$PY benches/guided.py --rounds 4 --json $OUT/guided.json

# 14. Speculative decoding by prompt lookup (session 8): the same greedy requests with 0, 3 and
# 6 drafts per step, at the default load limit, then drafting at any load.
$PY benches/speculative.py --rounds 3 --max-tokens 128 --drafts 3,6 --concurrency 1,4 \
  --json $OUT/speculative.json
# (speculative_any_load.json came from session 8's `--drafts 3 --concurrency 2,4 --max-running
# 0`; --max-running is now the R of `--drafts K/R/S`.)
# 15. The CPU default for speculation at load (session 9): drafts last, at any load, steps up
# to 16 tokens, against drafting only alone; then the two exploratory runs.
$PY benches/speculative.py --rounds 3 --max-tokens 128 --requests 8 --drafts 3/1/0,3/0/16 \
  --concurrency 2,4,8 --json $OUT/speculative_default.json
$PY benches/speculative.py --rounds 3 --max-tokens 128 --drafts 3/1/0,3/0/4,3/0/0 \
  --concurrency 2,4 --json $OUT/speculative_policies.json
$PY benches/speculative.py --rounds 2 --max-tokens 128 --requests 16 \
  --drafts 3/0/0,3/4/0,3/0/8,3/0/16 --concurrency 4,8,16 --workloads copy,open \
  --json $OUT/speculative_load.json
# (since session 10 a K/R/S setting drafts with the adaptive length, the engine's default; the
# runs above drafted a fixed K: add /fixed to each setting to repeat them as run.)
# 16. Adaptive draft length (session 10): fixed K against "at most one past the last accepted".
$PY benches/speculative.py --rounds 3 --max-tokens 128 --requests 8 \
  --drafts 3/0/16/fixed,3/0/16/adaptive --concurrency 2,4,8 --json $OUT/speculative_adaptive.json
# 17. Session 10 (an Intel Xeon with AVX-512): the block kernel up to 8 rows (blocks vs panels,
# side by side), the cap for drafted steps, the linear kernels' AVX-512 paths, the headline
# systems again, and serving at rates where transformers' TTFT explodes on this faster CPU.
$PY benches/model_forward.py --model smollm2 --compare-gguf-blocks --iters 7
$PY benches/speculative.py --rounds 3 --max-tokens 128 --requests 8 --drafts 3/0/16,3/0/8 \
  --concurrency 2,4,8 --json $OUT/speculative_cap8.json
$PY benches/cpu_kernels.py --json $OUT/cpu_kernels_avx512.json
for isa in avx2 avx512 avx2 avx512; do   # the shipped decode step under each instruction set
  FERROBATCH_CPU_ISA=$isa $PY benches/model_forward.py --model smollm2 --compare-gguf-blocks --iters 5
done
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-static,hf-static@16,hf-continuous \
  --json $OUT/throughput_cpu-small_session10_avx512.json
$PY benches/serving.py --servers ferrobatch,hf --workload cpu-serve --num-prompts 32 \
  --request-rates 0.8,1.6,3.2 --json $OUT/serving_cpu-serve_xeon.json
# 18. Session 11 (the same Xeon): decode attention split across threads, Q4_1 by table lookup;
# what one user sees; the headline systems again. (The attention "before" JSON was this command
# on git eb87ca9.)
$PY benches/cpu_kernels.py --only attention --json $OUT/attention_session11.json
$PY benches/model_forward.py --model smollm2 --compare-gguf-blocks
$PY benches/single_stream.py --lengths 256,1024,2000 --json $OUT/single_stream_session11.json
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-static,hf-static@16,hf-continuous \
  --json $OUT/throughput_cpu-small_session11.json
# 19. Session 12 (the same Xeon): every decoder layer of a decode step in one Rust call, side by
# side with the layer-by-layer forward (FERROBATCH_FUSED_DECODE=0), then the headline systems.
$PY benches/model_forward.py --model smollm2 --compare-fused-decode --iters 5
FERROBATCH_FUSED_DECODE=0 $PY benches/single_stream.py --lengths 256,1024,2000
$PY benches/single_stream.py --lengths 256,1024,2000
FERROBATCH_FUSED_DECODE=0 $PY benches/single_stream.py --lengths 256,1024,2000 \
  --json $OUT/single_stream_session12_per_layer.json
$PY benches/single_stream.py --lengths 256,1024,2000 --json $OUT/single_stream_session12.json
for fused in 0 1 0 1 0 1 0 1; do
  FERROBATCH_FUSED_DECODE=$fused $PY benches/throughput.py --workload cpu-small \
    --systems ferrobatch,ferrobatch-nodraft
done
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-static,hf-static@16,hf-continuous \
  --json $OUT/throughput_cpu-small_session12.json
# (after the block kernel's prefetch; the A/B against the commit before used a worktree build)
$PY benches/single_stream.py --lengths 256,1024,2000 --json $OUT/single_stream_session12_prefetch.json
for fused in 0 1; do
  suffix=$([ $fused = 0 ] && echo _per_layer)
  FERROBATCH_FUSED_DECODE=$fused $PY benches/serving.py --servers ferrobatch --workload cpu-serve \
    --num-prompts 32 --request-rates 0.8,1.6,3.2 --json $OUT/serving_cpu-serve_session12$suffix.json
done

# 20. Session 13 (the same Xeon): prompt chunks through the Rust prefill kernel and every step in
# one Rust call, side by side with prompt chunks on SDPA (FERROBATCH_PREFILL_KERNEL=0 = the
# engine at the session's start); then the headline systems.
$PY benches/cpu_kernels.py --only prefill --json $OUT/cpu_kernels_prefill_session13.json
$PY benches/prefill_latency.py --lengths 256,512,1024,2048 --repeat 3 \
  | tee $OUT/prefill_latency_session13.txt
for kernel in 0 1 0 1; do
  FERROBATCH_PREFILL_KERNEL=$kernel $PY benches/throughput.py --workload cpu-small \
    --systems ferrobatch,ferrobatch-nodraft
done
for kernel in 0 1; do
  suffix=$([ $kernel = 0 ] && echo _sdpa_prefill)
  FERROBATCH_PREFILL_KERNEL=$kernel $PY benches/serving.py --servers ferrobatch \
    --workload cpu-serve --num-prompts 32 --request-rates 0.8,1.6,3.2 \
    --json $OUT/serving_cpu-serve_session13$suffix.json
done
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-static,hf-static@16,hf-continuous \
  --json $OUT/throughput_cpu-small_session13.json

# 21. Session 14 (a Xeon with Intel AMX): linear layers of steps of 5+ rows through AMX tiles of
# the GGUF blocks, side by side with FERROBATCH_CPU_ISA=avx512 (no AMX = the session's start).
$PY benches/cpu_kernels.py --only amx --json $OUT/cpu_kernels_amx_session14.json
$PY benches/model_forward.py --model smollm2 --compare-amx --iters 3 \
  | tee $OUT/model_forward_amx_session14.txt
for isa in avx512 amx avx512 amx; do
  FERROBATCH_CPU_ISA=$isa $PY benches/throughput.py --workload cpu-small \
    --systems ferrobatch,ferrobatch-nodraft --no-progress
done  # -> $OUT/ab_amx_cpu-small_session14.txt
for isa in avx512 amx; do
  suffix=$([ $isa = avx512 ] && echo _no_amx)
  FERROBATCH_CPU_ISA=$isa $PY benches/serving.py --servers ferrobatch \
    --workload cpu-serve --num-prompts 32 --request-rates 0.8,1.6,3.2 \
    --json $OUT/serving_cpu-serve_session14$suffix.json
done
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-static,hf-static@16,hf-continuous \
  --no-progress --json $OUT/throughput_cpu-small_session14.json

# 22. Session 15: a float16 KV cache (--kv-cache-dtype float16) beside the float32 one: the
# kernels over the same values in both, then cpu-small with each, twice, and cpu-chat; decode
# attention's AVX-512 path against its AVX2 one; the headline systems with ferrobatch-kv16.
$PY benches/cpu_kernels.py --only kv16 --json $OUT/cpu_kernels_kv16_session15.json
for round in 1 2; do
  $PY benches/throughput.py --workload cpu-small --systems ferrobatch,ferrobatch-kv16 \
    --no-progress --json $OUT/throughput_cpu-small_kv16_session15_$round.json
done
$PY benches/throughput.py --workload cpu-chat --systems ferrobatch,ferrobatch-kv16 \
  --no-progress --json $OUT/throughput_cpu-chat_kv16_session15.json
for isa in avx2 avx512 avx2 avx512; do
  FERROBATCH_CPU_ISA=$isa $PY benches/cpu_kernels.py --only attention --repeats 7
done  # -> $OUT/ab_attention_avx512_session15.txt
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-kv16,ferrobatch-static,hf-static@16,hf-continuous \
  --no-progress --json $OUT/throughput_cpu-small_session15.json
for round in 1 2; do
  for kv in auto float16; do
    suffix=$([ $kv = float16 ] && echo _kv16)
    $PY benches/serving.py --servers ferrobatch --workload cpu-serve --num-prompts 32 \
      --request-rates 0.8,1.6,3.2 --ferrobatch-args "--kv-cache-dtype $kv" \
      --json $OUT/serving_cpu-serve_session15$suffix.json
  done
done

# 23. Session 16: prompt chunks' attention through Intel AMX (cpu_amx_prefill.rs): the kernel
# as shipped vs amx=False vs SDPA, then time to first token with and without it, then the
# headline systems.
$PY benches/cpu_kernels.py --only prefill --json $OUT/cpu_kernels_prefill_amx_session16.json
$PY benches/prefill_latency.py --lengths 512,2048,4096,6144 --paths fused,vector --repeat 2 \
  | tee $OUT/prefill_latency_amx_session16.txt
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-kv16,ferrobatch-static,hf-static@16,hf-continuous \
  --no-progress --json $OUT/throughput_cpu-small_session16.json

# 24. Session 17 (AMD EPYC, Zen 5, no AMX): the GGUF blocks as quantized panels
# (cpu_quant_panels.rs) against the float32 panels and the blocks, per row count; time to first
# token with and without them; then the headline systems with the float32-panel engine beside.
$PY benches/cpu_kernels.py --only blocks --repeats 7 \
  --json $OUT/cpu_kernels_quant_panels_session17.json
FERROBATCH_CPU_ISA=avx2 $PY benches/cpu_kernels.py --only blocks --repeats 5 \
  | tail -12 > $OUT/cpu_kernels_quant_panels_avx2_session17.txt
$PY benches/prefill_latency.py --lengths 512,2048,4096 --paths fused,f32panels --repeat 3 \
  | tee $OUT/prefill_latency_quant_panels_session17.txt
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-f32panels,ferrobatch-static,hf-static@16,hf-continuous \
  --no-progress --json $OUT/throughput_cpu-small_session17.json
$PY benches/serving.py --servers ferrobatch --workload cpu-serve --num-prompts 32 \
  --request-rates 0.8,1.6,3.2 --json $OUT/serving_cpu-serve_session17.json

# 25. Session 18 (the same AMD EPYC): decode attention with its intrinsics inlined again (the
# before/after logs ab_attention_inline_fix_*_session18.txt ran the older extension from a copy
# of the package: PYTHONPATH=<copy> for cpu_kernels.py and throughput.py, which import the first
# ferrobatch on the path); the headline, the ablation in alternating order, and serving.
$PY benches/cpu_kernels.py --only attention --repeats 5
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-nodraft,ferrobatch-f32panels,ferrobatch-static,hf-static@16,hf-continuous \
  --no-progress --json $OUT/throughput_cpu-small_session18.json
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,ferrobatch-static,ferrobatch,ferrobatch-f32panels,ferrobatch \
  --no-progress --json $OUT/throughput_cpu-small_ablation_abba_session18.json
$PY benches/serving.py --servers ferrobatch --workload cpu-serve --num-prompts 32 \
  --request-rates 0.8,1.6,3.2 --json $OUT/serving_cpu-serve_session18.json

# 26. Session 19 (an AMD EPYC Zen 3, AVX2 only): where the quantized panels take over on AVX2
# (three rounds), then the headline (git 01789c3 before, 10157f8 after) and serving side by
# side with transformers.
for round in 1 2 3; do
  $PY benches/cpu_kernels.py --only blocks --block-rows 1,2,3,4,5,6,7
done
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,ferrobatch-nodraft,hf-static@16,hf-continuous \
  --plot $OUT/throughput_cpu-small_zen3_session19_occupancy.png \
  --no-progress --json $OUT/throughput_cpu-small_zen3_session19.json
$PY benches/serving.py --servers ferrobatch,hf --workload cpu-serve --num-prompts 32 \
  --request-rates 0.8,1.6,3.2 --json $OUT/serving_cpu-serve_zen3_session19.json \
  --plot $OUT/serving_cpu-serve_zen3_session19_latency.png
$PY benches/speculative.py --drafts 3/0/4,3,3/0/16 --concurrency 1,2,4,8 --rounds 2 \
  --json $OUT/speculative_zen3_session19.json

# 27. Session 20 (the same Zen 3 type): the AVX2 block kernel's row loop in one call (git
# d22e32c before, 36fc4d0 after; the two alternated via PYTHONPATH copies, three rounds), the
# crossover re-measured, the draft default re-checked, the headline.
for round in 1 2 3; do
  $PY benches/single_stream.py --lengths 256 --tokens 64 --repeat 3
done
for round in 1 2; do
  $PY benches/cpu_kernels.py --only blocks --block-rows 2,3,4,5
done
$PY benches/speculative.py --drafts 3 --concurrency 1,2 --rounds 2 \
  --json $OUT/speculative_zen3_session20.json
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,ferrobatch-nodraft,hf-static@16,hf-continuous \
  --plot $OUT/throughput_cpu-small_zen3_session20_occupancy.png \
  --no-progress --json $OUT/throughput_cpu-small_zen3_session20.json

# 28. Session 21 (the same Zen 3 type): where a decode step's time goes; the attention thread
# threshold (git bb75aff before, c2c4858 after) and the stack's weight views (53df1b4), each
# alternated with a PYTHONPATH copy of the build before, two rounds; the headline.
for round in 1 2; do
  $PY benches/step_breakdown.py --rows 1,2,4,8 --repeats 7
  $PY benches/single_stream.py --lengths 256,512 --tokens 64 --repeat 3
done
for round in 1 2; do   # the sampler (git 53df1b4 before, 1c02bdd after)
  $PY benches/single_stream.py --lengths 256 --tokens 64 --repeat 3 --temperature 0.7 --top-p 0.9
done
$PY benches/step_breakdown.py --rows 1,2,4,8,16 --repeats 9 \
  --json $OUT/step_breakdown_zen3_session21.json
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,ferrobatch-nodraft,hf-static@16,hf-continuous \
  --plot $OUT/throughput_cpu-small_zen3_session21_occupancy.png \
  --no-progress --json $OUT/throughput_cpu-small_zen3_session21.json

# 29. Session 22 (the same Zen 3 type): decode attention's chunked softmax (git db45c3c before,
# 3b8e0ed after) and shared KV loads (3b8e0ed before, 3b5dc54 after) were measured on the kernel
# alone, alternating PYTHONPATH copies of the builds (throwaway scripts, figures in the README);
# the step, then the float16 cache's step (db45c3c before, two rounds), and one stream (the
# huge-page experiment, 9b36284 vs 3b5dc54, seven rounds; reverted in 0258d3c).
$PY benches/step_breakdown.py --rows 1,2,4,8,16 --repeats 9 \
  --json $OUT/step_breakdown_zen3_session22.json
for round in 1 2; do
  $PY benches/step_breakdown.py --rows 1,4,16 --kv-cache-dtype float16 --repeats 7
done
for round in 1 2 3 4; do
  $PY benches/single_stream.py --lengths 256,2000 --tokens 64 --repeat 3
done

# 30. Session 23 (the same Zen 3 type): the one-row Q4_1 linears (ed77644 before, 45d0459
# after), both builds in one process; BASE_SO = ed77644's ferrobatch/_scheduler.abi3.so, built in
# a worktree (`maturin build --release -o DIR`, then unzip it from the wheel).
if [ -n "${BASE_SO:-}" ]; then
  $PY benches/build_ab.py --base-so "$BASE_SO" --mode step --rows 1,2,3 --rounds 60 \
    --json $OUT/build_ab_step_zen3_session23.json
  $PY benches/build_ab.py --base-so "$BASE_SO" --mode stream --chat --temperature 0.7 \
    --rounds 10 --json $OUT/build_ab_stream_chat_zen3_session23.json
  $PY benches/build_ab.py --base-so "$BASE_SO" --mode stream --chat --rounds 10 \
    --json $OUT/build_ab_stream_chat_greedy_zen3_session23.json
  # the control: this build against a copy of itself
  cp python/ferrobatch/_scheduler.abi3.so /tmp/_scheduler_copy.abi3.so
  $PY benches/build_ab.py --base-so /tmp/_scheduler_copy.abi3.so --mode step --rows 1,2,3 \
    --rounds 60 --json $OUT/build_ab_step_control_zen3_session23.json
fi

# 31. Session 24 (the same Zen 3 type, git eac0f16): a fresh step breakdown and cpu-small
# headline, and the static ablation alternating.
$PY benches/step_breakdown.py --rows 1,2,4,8,16 --repeats 9 \
  --json $OUT/step_breakdown_zen3_session24.json
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,ferrobatch-nodraft,hf-static@16,hf-continuous \
  --plot $OUT/throughput_cpu-small_zen3_session24_occupancy.png --no-progress \
  --json $OUT/throughput_cpu-small_zen3_session24.json
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-static,ferrobatch-static,ferrobatch,ferrobatch,ferrobatch-static \
  --no-progress --json $OUT/throughput_cpu-small_ablation_abba_zen3_session24.json
$PY benches/engine_overhead.py --running 64,256,1024 --l1 16 --l2 48 \
  --json $OUT/engine_overhead_session24.json

# Session 45 (Xeon with AMX): the FP8 KV cache against float32 and float16: its quality on
# greedy chat replies, the decode kernel alone, 16-row steps, and cpu-small alternating.
$PY benches/kv_cache_quality.py --json $OUT/kv_cache_quality_session45.json
$PY benches/cpu_kernels.py --only kv16
for ctx in 256 1024; do
  for dt in auto float16 fp8; do
    $PY benches/step_breakdown.py --rows 16 --context $ctx --kv-cache-dtype $dt
  done
done
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-kv16,ferrobatch-kv8,ferrobatch,ferrobatch-kv16,ferrobatch-kv8 \
  --no-progress --json $OUT/throughput_cpu-small_kv_session45.json
$PY benches/throughput.py --workload cpu-chat --max-num-seqs 64 --kv-cache-gb 0.1 \
  --systems ferrobatch,ferrobatch-kv16,ferrobatch-kv8,ferrobatch,ferrobatch-kv16,ferrobatch-kv8 \
  --no-progress --json $OUT/throughput_cpu-chat_kv_budget_session45.json

# Session 46 (Xeon with AMX): the int8 KV cache (a scale per token and KV head) against float32
# and FP8: quality, the kernels alone, 16-row steps, cpu-small and the cache-bound cpu-chat.
$PY benches/kv_cache_quality.py --json $OUT/kv_cache_quality_session46.json
$PY benches/cpu_kernels.py --only kv16
for ctx in 256 1024; do
  for round in 1 2; do
    for dt in auto fp8 int8; do
      $PY benches/step_breakdown.py --rows 16 --context $ctx --kv-cache-dtype $dt
    done
  done
done
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-kv8,ferrobatch-kvi8,ferrobatch,ferrobatch-kv8,ferrobatch-kvi8 \
  --no-progress --json $OUT/throughput_cpu-small_kvi8_session46.json
$PY benches/throughput.py --workload cpu-chat --max-num-seqs 64 --kv-cache-gb 0.1 \
  --systems ferrobatch,ferrobatch-kv8,ferrobatch-kvi8,ferrobatch,ferrobatch-kv8,ferrobatch-kvi8 \
  --no-progress --json $OUT/throughput_cpu-chat_kv_budget_session46.json

# Session 47 (Xeon with AMX): int8 decode with the row scales read inside the passes, against
# the session 46 build (BASE_SO: its _scheduler*.so, built as build_ab.py's docstring says),
# then the caches side by side, 16-row steps, whole runs, and the greedy read-back's phases.
if [ -n "${BASE_SO:-}" ]; then
  $PY benches/build_ab.py --base-so "$BASE_SO" --mode attention --rows 1,16,64 \
    --contexts 256,1024 --rounds 20
  $PY benches/build_ab.py --base-so "$BASE_SO" --mode step --kv-cache-dtype int8 \
    --rows 1,16,64 --context 256 --num-blocks 1300 --rounds 20
  $PY benches/build_ab.py --base-so "$BASE_SO" --mode step --kv-cache-dtype int8 \
    --rows 16 --context 1024 --num-blocks 1200 --rounds 20
fi
$PY benches/cpu_kernels.py --only kv16
for ctx in 256 1024; do
  for round in 1 2; do
    for dt in auto fp8 int8; do
      $PY benches/step_breakdown.py --rows 16 --context $ctx --kv-cache-dtype $dt
    done
  done
done
$PY benches/throughput.py --workload cpu-small \
  --systems ferrobatch,ferrobatch-kv8,ferrobatch-kvi8,ferrobatch,ferrobatch-kv8,ferrobatch-kvi8 \
  --no-progress --json $OUT/throughput_cpu-small_kvi8_session47.json
$PY benches/throughput.py --workload cpu-chat --max-num-seqs 64 --kv-cache-gb 0.1 \
  --systems ferrobatch,ferrobatch-kv8,ferrobatch-kvi8,ferrobatch,ferrobatch-kv8,ferrobatch-kvi8 \
  --no-progress --json $OUT/throughput_cpu-chat_kv_budget_session47.json
$PY benches/step_phases.py --workload cpu-small

# Session 48 (Xeon with AMX): the CPU sampler's draw in Rust, against torch's (the same engine,
# switched run by run), then single-stream sampled decoding with each draw, alternating.
$PY benches/sampler.py --json $OUT/sampler_session48.json
for round in 1 2; do
  for v in 0 1; do
    FERROBATCH_RUST_SAMPLER=$v $PY benches/single_stream.py --lengths 32,256,1024 --repeat 3 \
      --temperature 0.7 --top-p 0.9
  done
done
$PY benches/single_stream.py --lengths 32,256,1024 --repeat 3

# Session 1, the old forward, on the loaded machine (load 6-11, one torch thread per process):
# $PY benches/throughput.py --workload cpu-small \
#   --systems ferrobatch,ferrobatch-static,hf-static@16,hf-continuous,hf-static@8 \
#   --threads 1 --json $OUT/throughput_cpu-small_loaded.json

# Session 49 (Xeon with AMX): one row of Q4_1 in int16 dot products (cpu_q4_1_one_row.rs).
# BASE_SO = d4d3d9d's ferrobatch/_scheduler.abi3.so (built as build_ab.py's docstring says);
# COPY_SO = a copy of this build's, the A/A control run right after each comparison.
if [ -n "${BASE_SO:-}" ]; then
  COPY_SO=/tmp/_scheduler_copy.abi3.so
  cp python/ferrobatch/_scheduler.abi3.so "$COPY_SO"
  $PY benches/one_row_linear.py --base-so "$BASE_SO" --rounds 25 \
    --json $OUT/one_row_linear_session49.json
  $PY benches/one_row_linear.py --base-so "$COPY_SO" --rounds 25 \
    --json $OUT/one_row_linear_control_session49.json
  $PY benches/build_ab.py --base-so "$BASE_SO" --mode step --rows 1,2,3 --rounds 300 \
    --json $OUT/build_ab_step_session49.json
  $PY benches/build_ab.py --base-so "$COPY_SO" --mode step --rows 1,2,3 --rounds 300 \
    --json $OUT/build_ab_step_control_session49.json
  $PY benches/build_ab.py --base-so "$BASE_SO" --mode stream --chat --rounds 12 \
    --json $OUT/build_ab_stream_chat_greedy_session49.json
  $PY benches/build_ab.py --base-so "$COPY_SO" --mode stream --chat --rounds 12 \
    --json $OUT/build_ab_stream_chat_greedy_control_session49.json
fi
