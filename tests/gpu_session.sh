#!/usr/bin/env bash
# One GPU lease's checks and measurements (issue 43), in priority order, each under its own time limit
# so that a slow or failing step leaves the next ones their turn. Run from the project root on the
# GPU host after `. .gpu/host.sh` has joined the model (docs/gpu.md); logs under $OUT (or ./gpu-out).
#   1. the CUDA-only tests of the fixed-shape decoder (capture, replay, deterministic mode, moved weights)
#   2. make bench's part 8: HF generate against the fixed-shape decoder, eager and from CUDA graphs
#   3. tests/bench_ref.py's GPU shape (16 prompts x 8 samples x 128 tokens), posttrain and TRL, fp32
#   4. the smollm2-135m preset through the real CLI (Prefect, MLflow on SQLite)
#   5. as 3 in bf16; 6. part 8 and posttrain's step with POSTTRAIN_DETERMINISTIC=0
set -u
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
ref() {  # ref TOOL PRECISION [args]: one bench_ref session; its BENCH line to ref.txt, its log's end to ref-err.txt
  local tool=$1 precision=$2; shift 2
  local t0=$SECONDS
  timeout 150 python3 -m tests.bench_ref --tool "$tool" --shape smollm2-gpu --precision "$precision" "$@" \
    >/tmp/ref.out 2>/tmp/ref.err
  local rc=$?
  echo "# $tool $precision $* det=${POSTTRAIN_DETERMINISTIC:-1} rc $rc $((SECONDS - t0))s" >>"$O/ref.txt"
  grep '^BENCH ' /tmp/ref.out >>"$O/ref.txt"
  { echo "=== $tool $precision $* rc $rc"; tail -25 /tmp/ref.err; } >>"$O/ref-err.txt"
}
{ nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; nproc; } \
  >"$O/env.txt" 2>&1
# the GGUF into a safetensors folder once (every later step reads it from the cache) beside the tests
python3 -c "import os; from trainer.model import resolve_pretrained; print(resolve_pretrained(os.environ['POSTTRAIN_GGUF']))" \
  >>"$O/env.txt" 2>&1 &
[ "${SKIP_TESTS:-0}" = 1 ] ||  # (already run in the lease's first call, before the model arrived)
  step 150 tests.txt python3 -m pytest -q -p no:cacheprovider -rs tests/test_fixed_decoder.py -k "graph or weights_that_move"
wait
step 120 decode.txt python3 -m tests.bench --only decode
ref posttrain fp32
ref trl fp32
step 300 speedrun.txt python3 -m flows.cli speedrun --preset smollm2-135m --set "model.pretrained=$POSTTRAIN_GGUF"
ref posttrain bf16
ref trl bf16
POSTTRAIN_DETERMINISTIC=0 step 120 decode.txt python3 -m tests.bench --only decode
POSTTRAIN_DETERMINISTIC=0 ref posttrain fp32
ref trl fp32 --batching
echo "all steps ran: $SECONDS s" >>"$O/env.txt"
