#!/usr/bin/env bash
# One GPU lease's checks and measurements (issue 43), in priority order, each under its own time limit
# so that a slow or failing step leaves the next ones their turn. Run from the project root on the
# GPU host after `. .gpu/host.sh` has joined the model (docs/gpu.md); logs under $OUT (or ./gpu-out).
#   1. the CUDA-only tests of the fixed-shape decoder (capture, replay, deterministic mode, moved
#      weights), of the fused norms (fewer operators, deterministic backward) and of the TF32 switch
#      (14 tests, 37 s on an H200); SKIP_TESTS=1 when an earlier call of the lease ran them
#   2. where the time goes: python -m tests.gpu_profile (the decoder's step with sampling captured and
#      eager, fp32 and bf16; the update's phases and top operators, bf16 and fp32 at ZeRO stage 0, and
#      bf16 without the deterministic mode)
#   3. `make bench` on a GPU (python -m tests.bench): posttrain against TRL, fp32 and bf16, with the
#      floors, then HF generate against the fixed-shape decoder (TRL's continuous batching only with
#      BENCH_ALL=1: it ran at a third of plain generate's speed, docs/gpu.md; fp32 on TF32 tensor cores,
#      posttrain's model.tf32 against TRL's tf32=True, with TF32=1)
#   4. the smollm2-135m preset through the real CLI (Prefect, MLflow on SQLite), as shipped; then with
#      POSTTRAIN_DETERMINISTIC=0 where NONDET=1
#   (variants, asked for by name: the decoder as shipped against itself with one change at a time undone,
#   python -m tests.gpu_profile variants, about a minute)
# STEPS="profile bench" (say) runs those of tests, variants, profile, bench, speedrun only: a lease can split
# them over calls (a call takes at most 600 s; the machine and /tmp stay while it is warm).
set -u
STEPS=" ${STEPS:-tests profile bench speedrun} "
[ "${SKIP_TESTS:-0}" = 1 ] && STEPS=${STEPS/ tests / }
want() { [[ $STEPS == *" $1 "* ]]; }
O=${OUT:-gpu-out}
mkdir -p "$O"
: "${POSTTRAIN_GGUF:?source .gpu/host.sh first: it names the model}"
step() {  # step SECONDS LOG command...: the command's output appended to LOG, its time and status after it
  local limit=$1 log=$2; shift 2
  local t0=$SECONDS
  echo "=== $* (limit ${limit}s) $(date -u +%T)" >>"$O/$log"
  timeout "$limit" "$@" >>"$O/$log" 2>&1
  echo "=== rc $? after $((SECONDS - t0))s" >>"$O/$log"
}
{ nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; nproc; } \
  >"$O/env.txt" 2>&1
# the GGUF into a safetensors folder once (every later step reads it from the cache) beside the tests
python3 -c "import os; from trainer.model import resolve_pretrained; print(resolve_pretrained(os.environ['POSTTRAIN_GGUF']))" \
  >>"$O/env.txt" 2>&1 &
! want tests ||
  step 150 tests.txt python3 -m pytest -q -p no:cacheprovider -rs tests/test_fixed_decoder.py tests/test_fused_norms.py \
    tests/test_tf32.py -k "graph or weights_that_move or captured or on_cuda or tf32 or rounds_where"
wait
! want variants || step 200 variants.txt python3 -m tests.gpu_profile variants
! want profile || step 150 profile.txt python3 -m tests.gpu_profile
SESSIONS="TRL fp32;posttrain fp32;posttrain fp32, not deterministic;TRL bf16;posttrain bf16;posttrain bf16, not deterministic"
[ "${BENCH_ALL:-0}" = 1 ] && SESSIONS="$SESSIONS;TRL fp32, continuous batching"
[ "${TF32:-0}" = 1 ] && SESSIONS="$SESSIONS;TRL fp32, TF32;posttrain fp32, TF32"
! want bench || { step 360 bench.txt python3 -m tests.bench --gpu-sessions "$SESSIONS"; cp bench-results/bench.json "$O/" 2>/dev/null; }
! want speedrun ||
  step 200 speedrun.txt python3 -m flows.cli speedrun --preset smollm2-135m --set "model.pretrained=$POSTTRAIN_GGUF"
[ "${NONDET:-0}" = 1 ] && POSTTRAIN_DETERMINISTIC=0 step 200 speedrun-nondet.txt python3 -m flows.cli speedrun \
  --preset smollm2-135m --set "model.pretrained=$POSTTRAIN_GGUF" --recompute grpo
echo "all steps ran: $SECONDS s" >>"$O/env.txt"
