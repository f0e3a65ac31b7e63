#!/usr/bin/env bash
# THE one GPU check of the CUDA kernels (issue #5). On the GPU machine, from the checkout root:
#
#     source .device/env.sh && bash benches/gpu_check.sh
#
# (.device/ is made beforehand on the dev machine by `bash ../shared/device/prepare.sh ninja`.)
# Steps, most important first, each with its own time limit and all within one overall budget
# (GPU_CHECK_BUDGET_S, default 540 s: a step never starts with less than 30 s left and is cut at
# the budget, so the summary is always written before the device call's own time limit):
#   1. environment (GPU, clocks, torch/CUDA versions, nvcc)                        -> env.txt
#   2. build: JIT-build the kernels for this GPU (sm_90), ptxas register report   -> build.log, ptxas.txt
#   3. tests: pytest -m gpu tests/gpu (+ multi-LoRA at the runner) (kernels vs float64, CUDA graphs, e2e)       -> gpu_tests.log/.xml
#   4. bench: decode-attention bandwidth (+ measured copy rate; split shapes with the fused
#      reduce and the reduce pass side by side), then prefill attention:
#      ferrobatch's kernel vs FlashAttention-2 (session 30)   -> attention_bandwidth.*, prefill_attention.*
#   5. small: gpu-small with torch's elementwise modules instead of the fused kernels (the
#      default since session 30, behind a start-up check), as shipped, with decode graphs
#      only, and with rotary apart from the K/V write (two kernels per layer, as before session
#      33) (issue #6; no graphs at all: 5,668 out tok/s on 2026-12-04, no longer run)
#                                                                                 -> throughput_gpu-small.*
#   6. 8b: gpu-8b, with FlashAttention prefill (the default since session 30) and with
#      ferrobatch's prefill kernel (ferrobatch-nativeprefill) (issue #6)          -> throughput_gpu-8b.*
#   7. ablation: continuous vs static on gpu-small at cap 32 (bound 1.59x), and
#      continuous with decode graphs only, with ferrobatch's prefill kernel instead of
#      FlashAttention (each refill is a mixed step: on 2026-12-04 run 1 the kernel won, 1.11x),
#      with the mixed steps split as before session 31 (FlashAttention for the prefill
#      rows only, decode kernel for the rest), and with the decode kernel's splits combined by
#      a reduce pass (before session 33; at cap 32 decode steps split the KV), and with
#      refills four requests at a time (--admission-batch 4)                       -> throughput_gpu-small_ablation.*
#   8. phases: where a gpu-small step's time goes, at cap 256 and 32               -> step_phases*.{txt,json}
#   8b. profile: one gpu-small-shaped step at a time (decode B=32/128/256 at ctx 1024, a cap-32
#      refill): the graph step's ms against its kernels' device time, and the top kernels
#      (session 31; never run yet)                                                -> kernel_profile.{txt,json}
#   9. splits: the decode kernel at fixed split counts 1..32                       -> splits_sweep.txt, splits_*.json
#  10. hf, hf8b: ferrobatch and hf-static side by side on gpu-small / gpu-8b       -> throughput_gpu-*_hf.*
#  11. sanitizer: compute-sanitizer memcheck on a few small kernel tests (no caching
#      allocator, so an out-of-bounds access hits unallocated memory), if the tool is there -> sanitizer.log
#  12. spec: speculative decoding on CUDA, drafting alone and at load             -> speculative_cuda.{txt,json}
#  13. hfcb: ferrobatch and transformers' continuous batching (hf-continuous) on gpu-small
#      (never run on the GPU yet)                                                 -> throughput_gpu-small_hfcb.*
#  14. lora: benches/lora.py on CUDA (base, base-eager, one and four adapters, lora-4-eager) -> lora_cuda.{txt,json}
#  15. chat: the gpu-chat workload (1000 requests, chat-like lengths, Llama-3-8B shape; never
#      run on the GPU yet)                                                         -> throughput_gpu-chat.*
#  then the summary table                                                          -> summary.txt
# (2026-12-04, first H200 runs: build 28 s, tests 45 s, bench 10 s, small / 8b 27 s each, ablation
# 45 s, splits 71 s, hf 113 s, hf8b > 150 s, sanitizer 12 s, spec 50 s.)
# (Session 29 added piecewise graphs: `small` now runs three engines and two of them capture
# graphs at start-up, `ablation` three; their durations above are from before.)
# GPU_CHECK_STEPS=tests,bench,... runs only the named steps (the build always runs).
# The logs go to $OUT/logs/ while the steps run; at the end they are packed into
# $OUT/gpu_check_logs.tar.gz beside $OUT/summary.txt (the device tool returns at most 8 files), and
# copied to benches/results/gpu-<stamp>/. The end-to-end parity tests use the shipped SmolLM2 GGUF,
# else $FERROBATCH_E2E_GGUF, else .device/e2e.gguf (SmolLM2's first blocks, written by
# tests/gpu/truncate_gguf.py: the full file is too big to travel).
# A step that fails is recorded and the script continues; the exit code is non-zero if any failed.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
TOP=${OUT:-$root/benches/results/gpu-$stamp}
OUT=$TOP/logs
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export FERROBATCH_CACHE_DIR=${FERROBATCH_CACHE_DIR:-/tmp/ferrobatch-cache}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# Use the installed wheel when it imports; otherwise the source tree (kernels then come from cuda/).
if ! $PY -c "import ferrobatch.runtime.cuda_ops" >/dev/null 2>&1; then
  export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
fi

if [[ -z ${FERROBATCH_E2E_GGUF:-} && -f $root/.device/e2e.gguf ]] \
    && ! $PY -c "from ferrobatch.model.loader import smollm2_gguf_path as p; p()" >/dev/null 2>&1; then
  export FERROBATCH_E2E_GGUF=$root/.device/e2e.gguf
fi
timeout_flag=()
$PY -c "import pytest_timeout" >/dev/null 2>&1 && timeout_flag=(--timeout 120)

budget=${GPU_CHECK_BUDGET_S:-540}
steps=${GPU_CHECK_STEPS:-tests,bench,small,8b,ablation,phases,profile,splits,hf,hf8b,sanitizer,spec,hfcb,lora,chat}
tests=${GPU_CHECK_TESTS:-tests/gpu tests/model/test_lora_runner.py}
want() { [[ ",$steps," == *",$1,"* ]]; }
declare -A status
run_step() {  # name timeout_s logfile cmd...
  local name=$1 limit=$2 log=$3; shift 3
  if [[ $name != build ]] && ! want "$name"; then
    return 0
  fi
  local left=$((budget - SECONDS))
  if (( left < 30 )); then
    status[$name]="skipped (budget: ${left}s left)"
    echo "=== [$name] ${status[$name]}" | tee -a "$OUT/steps.txt"
    return 1
  fi
  (( limit > left )) && limit=$left
  local t0=$SECONDS
  echo "=== [$name] $* (limit ${limit}s)" | tee -a "$OUT/steps.txt"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  status[$name]="rc=$rc $((SECONDS - t0))s"
  echo "=== [$name] ${status[$name]}" | tee -a "$OUT/steps.txt"
  tail -n 5 "$log"
  return $rc
}

failed=0
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv || true
  $PY -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); p = torch.cuda.get_device_properties(0); print(p.name, 'cc', f'{p.major}.{p.minor}', 'SMs', p.multi_processor_count, 'L2', getattr(p, 'L2_cache_size', '?'))"
  command -v nvcc && nvcc --version | tail -2
  $PY -c "import shutil; import ninja; print('ninja wheel', ninja.BIN_DIR, 'on PATH:', shutil.which('ninja'))" \
    || echo "no ninja wheel: the JIT build needs ninja (bash ../shared/device/prepare.sh ninja)"
  $PY -c "import ferrobatch, ferrobatch.runtime.cuda_ops as o; print('ferrobatch', ferrobatch.__file__); print('sources', o.cuda_source_dir()); print('toolkit', o.find_cuda_toolkit())"
  git -C "$root" log --oneline -1 2>/dev/null || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

run_step build 360 "$OUT/build.log" $PY -m ferrobatch.runtime.cuda_ops --build --verbose || failed=1
grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" \
  | sed -E 's/ptxas info *: //' | paste - - - >"$OUT/ptxas.txt" 2>/dev/null || true

if [[ ${status[build]} == rc=0* ]]; then
  echo "e2e model: ${FERROBATCH_E2E_GGUF:-the shipped SmolLM2}" >>"$OUT/env.txt"
  run_step tests 300 "$OUT/gpu_tests.log" $PY -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    "${timeout_flag[@]}" --durations=15 --junitxml="$OUT/gpu_tests.xml" $tests || failed=1
  run_step bench 180 "$OUT/attention_bandwidth.txt" bash -c "set -o pipefail; $PY benches/attention_bandwidth.py \
      --measure-copy --json $OUT/attention_bandwidth.json && $PY benches/prefill_attention_cuda.py \
      --json $OUT/prefill_attention.json | tee $OUT/prefill_attention.txt" || failed=1
  run_step small 200 "$OUT/throughput_gpu-small.txt" $PY benches/throughput.py \
    --workload gpu-small --systems ferrobatch-torchops,ferrobatch,ferrobatch-decodegraphs,ferrobatch-rotaryapart \
    --no-progress \
    --max-num-seqs 256 \
    --json "$OUT/throughput_gpu-small.json" || failed=1
  run_step 8b 240 "$OUT/throughput_gpu-8b.txt" $PY benches/throughput.py \
    --workload gpu-8b --systems ferrobatch,ferrobatch-nativeprefill --no-progress \
    --max-num-seqs 256 \
    --json "$OUT/throughput_gpu-8b.json" || failed=1
  run_step ablation 150 "$OUT/throughput_gpu-small_ablation.txt" $PY benches/throughput.py \
    --workload gpu-small --systems ferrobatch@32,ferrobatch-static@32,ferrobatch-decodegraphs@32,ferrobatch-nativeprefill@32,ferrobatch-splitmixed@32,ferrobatch-reducepass@32,ferrobatch-refill4@32 \
    --no-progress \
    --json "$OUT/throughput_gpu-small_ablation.json" || failed=1
  # where a step's time goes (schedule / graph replay / eager model / sampler / outside the step)
  run_step phases 120 "$OUT/step_phases.txt" bash -c "$PY benches/step_phases.py --workload gpu-small \
      --max-num-seqs 256 --json $OUT/step_phases_gpu-small.json && $PY benches/step_phases.py \
      --workload gpu-small --max-num-seqs 32 --json $OUT/step_phases_gpu-small_cap32.json" || failed=1
  # one step's kernels: graph step vs the sum of its kernels' device time, top kernels
  run_step profile 120 "$OUT/kernel_profile.txt" $PY benches/gpu_kernel_profile.py \
      --json "$OUT/kernel_profile.json" || failed=1
  # the decode kernel at each fixed split count (the heuristic's choice is the bench step's)
  run_step splits 150 "$OUT/splits_sweep.txt" bash -c 'for s in 1 2 3 4 6 8 12 16 24 32; do
      echo "== num_splits $s"; '"$PY"' benches/attention_bandwidth.py --num-splits $s \
        --torch-ref-max-gb 0 --json "'"$OUT"'/splits_$s.json" | grep -E "^(shape|llama|smollm)"
    done' || failed=1
  # transformers in the same run: gpu-small, then gpu-8b (hf-static at the workload's batch size)
  run_step hf 150 "$OUT/throughput_gpu-small_hf.txt" $PY benches/throughput.py \
    --workload gpu-small --systems ferrobatch,hf-static --no-progress --max-num-seqs 256 \
    --json "$OUT/throughput_gpu-small_hf.json" || failed=1
  run_step hf8b 240 "$OUT/throughput_gpu-8b_hf.txt" $PY benches/throughput.py \
    --workload gpu-8b --systems ferrobatch,hf-static --no-progress --max-num-seqs 256 \
    --json "$OUT/throughput_gpu-8b_hf.json" || failed=1
  if want sanitizer && command -v compute-sanitizer >/dev/null 2>&1; then
    run_step sanitizer 150 "$OUT/sanitizer.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
      $PY -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_kernels.py -k \
      "3-700-16-2-4-128-dtype0 or 7-1000-12-3-3-64-dtype1 or 3-2-4-128-dtype0 or 4-3-3-64-dtype0 or slot_dtype0-128-8-dtype0 or zero_length" \
      || failed=1
  fi
  # lowest priority: speculative decoding on CUDA (off there by default: never measured)
  run_step spec 120 "$OUT/speculative_cuda.txt" $PY benches/speculative.py --device cuda \
    --model "${FERROBATCH_E2E_GGUF:-smollm2}" \
    --rounds 2 --max-tokens 128 --requests 8 --drafts 3/0/0,3/8/0 --concurrency 1,8 \
    --json "$OUT/speculative_cuda.json" || failed=1
  # transformers' own continuous batching (ContinuousBatchingManager, its CUDA graphs auto)
  run_step hfcb 240 "$OUT/throughput_gpu-small_hfcb.txt" $PY benches/throughput.py \
    --workload gpu-small --systems ferrobatch,hf-continuous --no-progress --max-num-seqs 256 \
    --json "$OUT/throughput_gpu-small_hfcb.json" || failed=1
  # LoRA on CUDA (session 36, never run on a GPU): steps with adapter rows run eagerly
  run_step lora 150 "$OUT/lora_cuda.txt" $PY benches/lora.py --device cuda \
    --model "${FERROBATCH_E2E_GGUF:-smollm2}" --num 32 --rounds 2 \
    --json "$OUT/lora_cuda.json" || failed=1
  # the chat-like length mix on the 8B shape (1000 requests; never run on the GPU yet)
  run_step chat 240 "$OUT/throughput_gpu-chat.txt" $PY benches/throughput.py \
    --workload gpu-chat --systems ferrobatch --no-progress \
    --json "$OUT/throughput_gpu-chat.json" || failed=1
else
  echo "build failed: skipping tests and bench" | tee -a "$OUT/steps.txt"
  failed=1
fi

{
  echo "ferrobatch GPU check $stamp  ($(head -n 2 "$OUT/env.txt" | tail -n 1))"
  for k in build tests bench small 8b ablation phases profile splits hf hf8b sanitizer spec hfcb lora chat; do echo "  $k: ${status[$k]:-not run}"; done
  echo "--- tests"
  grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -n 3
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" 2>/dev/null | head -n 15
  echo "--- sanitizer"
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" 2>/dev/null | tail -n 3
  echo "--- decode attention bandwidth (bf16, block 16)"
  awk '/^shape /{on=1} on{print} /^goal /{exit}' "$OUT/attention_bandwidth.txt" 2>/dev/null   # (the prefill bench follows in that file)
  echo "--- prefill attention: ferrobatch's kernel vs FlashAttention-2 (bf16, ms per layer)"
  cat "$OUT/prefill_attention.txt" 2>/dev/null
  echo "--- offline throughput (goals: gpu-small >= 40,000 and gpu-8b >= 6,000 output tok/s)"
  grep -hE "^  ferrobatch" "$OUT/throughput_gpu-small.txt" "$OUT/throughput_gpu-8b.txt" 2>/dev/null
  echo "--- start-up checks that turned a path off (FlashAttention prefill, fused elementwise ops)"
  grep -hE "not used|disagree|FlashAttention-2 failed" "$OUT"/throughput_*.txt 2>/dev/null \
    | sort | uniq -c | head -n 5
  echo "--- against transformers (hf-static, hf-continuous), same run each"
  grep -hE "^  (ferrobatch|hf-static|hf-continuous)" "$OUT/throughput_gpu-small_hf.txt" \
    "$OUT/throughput_gpu-8b_hf.txt" "$OUT/throughput_gpu-small_hfcb.txt" 2>/dev/null
  echo "--- gpu-chat (1000 requests, chat-like lengths, Llama-3-8B shape)"
  grep -hE "^  ferrobatch" "$OUT/throughput_gpu-chat.txt" 2>/dev/null
  echo "--- decode kernel at fixed split counts (GB/s; see splits_sweep.txt)"
  grep -cE "^(llama|smollm)" "$OUT/splits_sweep.txt" 2>/dev/null
  echo "--- step phases, gpu-small at cap 256 then 32 (ms per step)"
  grep -E "^(workload|schedule|model|greedy|finite|sample|update|rest|outside)" "$OUT/step_phases.txt" 2>/dev/null
  echo "--- one step's kernels (graph step vs its kernels' device time; top kernels)"
  grep -vE "^(json|USDT)" "$OUT/kernel_profile.txt" 2>/dev/null | head -n 70
  echo "--- continuous vs static batching, gpu-small at cap 32 (goal 1.5x; schedule bound 1.59x)"
  grep -hE "^ablation at cap|^  ferrobatch" "$OUT/throughput_gpu-small_ablation.txt" 2>/dev/null
  echo "--- speculative decoding on CUDA (prompt lookup; ratios to no drafts, same token ids?)"
  sed -n '/^workload /,/^wrote/p' "$OUT/speculative_cuda.txt" 2>/dev/null | grep -v '^wrote'
  echo "--- registers (ptxas) of the decode kernels, bf16"
  grep -E "paged_decode_kernelI13__nv_bfloat16" "$OUT/ptxas.txt" 2>/dev/null \
    | sed -E 's/.*kernelI13__nv_bfloat16Li([0-9]+)ELi([0-9]+)ELb([01]).*Used ([0-9]+) registers.*/  D=\1 GP=\2 direct=\3: \4 regs/' | sort -u
} >"$OUT/summary.txt"

# keep a copy in the repo tree (on the GPU machine the tree is discarded; $TOP comes back)
if [[ $TOP != "$root/benches/results/"* ]]; then
  mkdir -p "$root/benches/results/gpu-$stamp" && cp -r "$OUT"/. "$root/benches/results/gpu-$stamp/" 2>/dev/null || true
fi
cp "$OUT/summary.txt" "$TOP/summary.txt"
tar czf "$TOP/gpu_check_logs.tar.gz" -C "$OUT" . && rm -rf "$OUT"
cat "$TOP/summary.txt"
exit $failed
