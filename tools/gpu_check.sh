#!/usr/bin/env bash
# The first GPU run, one command: on a machine with one NVIDIA GPU (and the venv of `make setup`, with the `gpu`
# extra for vLLM), in under 10 minutes, it runs
#   1. the GPU tests (tests/gpu: bf16 on CUDA, an NCCL group, vLLM sleep mode and weight reload, the memory model
#      against torch.cuda's peak memory for a trainer step and a rollout rank),
#   2. a switch (dynaresize run, 3 ranks, 1:2 -> 2:1 forced at step 2: a split needs a rank per role, so a switch
#      needs 3): on cluster.device=cuda with NCCL where 3 GPUs are visible; NCCL takes one GPU per rank, so with fewer
#      the switch runs on cluster.device=cpu (gloo) and the CUDA paths are those of step 1,
#   3. the memory check: config check of configs/gpu-8x1.yaml against this GPU's own memory (cluster.gpu_memory_gb
#      unset: read from the device) and tools/bench_memory.py's CPU table,
# then prints one table: check, result, seconds.
#
# NOT RUN YET: no GPU was lent to the work that wrote it; it cannot run on the CPU machine it was written on.
#   tools/gpu_check.sh            (PY=path/to/python to choose the interpreter; default .venv/bin/python)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=$(mktemp -d)
declare -a ROWS
row() { ROWS+=("$(printf '%-34s %-6s %6ss  %s' "$1" "$2" "$3" "$4")"); }
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then row "$name" ok $((SECONDS - t0)) "$OUT/$name.log"
  else row "$name" FAIL $((SECONDS - t0)) "$OUT/$name.log (rc $?)"; fi
}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA GPU visible to $PY; nothing to check" >&2
  exit 2
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
run gpu-tests 300 "$PY" -m pytest -p no:xdist -q -m gpu tests/gpu
if [ "$NGPU" -ge 3 ]; then DEV=cuda; else DEV=cpu; fi
run "switch-1:2-to-2:1-$DEV" 240 "$PY" -m dynaresize.cli run configs/quickstart.yaml cluster.device=$DEV cluster.gpus=3 \
  cluster.initial_train=1 run.steps=4 "policy.forced_splits={2: 2}" run.output_dir="$OUT/runs" \
  model.tiny.warmstart_steps=20 --quiet
run memory-config-check 60 "$PY" -m dynaresize.cli config check configs/gpu-8x1.yaml cluster.gpu_memory_gb=null
run bench-memory-small 120 "$PY" tools/bench_memory.py --sizes small medium --roles trainer rollout
echo
printf '%-34s %-6s %7s  %s\n' check result time log
for r in "${ROWS[@]}"; do echo "$r"; done
grep -h "max_rel_error" "$OUT/bench-memory-small.log" 2>/dev/null | cut -c1-120
! printf '%s\n' "${ROWS[@]}" | grep -q " FAIL "
