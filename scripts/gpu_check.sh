#!/usr/bin/env bash
# The GPU check: what can only be proven on a GPU, in one run of under 9.5 minutes on one GPU.
#
#   scripts/gpu_check.sh full   # a GPU machine with the whole stack (make install, CUDA torch)
#   scripts/gpu_check.sh bare   # a GPU machine with CUDA torch alone (no vLLM, Ray or DeepSpeed)
#
# full: the GPU tests (pytest -m gpu); rollout tokens/s of elasticrl's engine against bare vLLM
#   on the same prompts and engine arguments; weight-sync GB/s (sliced and gathered, ipc and
#   broadcast) against the device copy bandwidth measured in the same run; one GRPO step of the
#   50m world split by phase, hybrid (colocate: all) and separate (the latter with 3 GPUs or more).
# bare: the weights layer's transports between plain torch processes (CUDA IPC, and NCCL point
#   to point when there is a GPU per process) into receivers laid out as vLLM's workers,
#   checked bit-exact and timed against the device copy; then a DeepSpeed training step when
#   deepspeed imports.
# Prints JSON lines (and pytest's summary); OUT (default ./gpu-check) keeps every output.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-full}
OUT=${OUT:-gpu-check}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
status=0
step() {  # step NAME TIMEOUT_S COMMAND...: run, keep its output, remember a failure, go on
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -E '^\{|passed|failed|skipped|error' || true
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "== $name: exit $rc (see $OUT/$name.log)"; status=1; }
}

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.cuda.get_device_name(0))" \
  || exit 2

case "$MODE" in
  bare)
    step transports 240 $PY scripts/sync_check.py --device cuda --senders 2 --receivers 1,2 --hidden 1024 --layers 8
    step delta 120 $PY scripts/sync_check.py --device cuda --senders 2 --receivers 1 --hidden 1024 --layers 8 --delta
    if $PY -c "import deepspeed" 2>/dev/null; then
      step deepspeed_step 180 $PY scripts/sync_check.py --deepspeed-step
    else
      echo '{"deepspeed_step": "skipped: deepspeed does not import"}'
    fi
    ;;
  full)
    # the step limits add up to 9 minutes (the GPU tests: 3.5, QLoRA GRPO included)
    step gpu_tests 210 $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider
    step rollout_vs_vllm 60 $PY benchmarks/rollout.py --against vllm --prompts 64 --new-tokens 128 --repeats 2
    gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
    if [ "$gpus" -ge 3 ]; then  # two trainer ranks and an engine, a GPU each
      step weight_sync 90 $PY benchmarks/weight_sync.py --suite senders --transports ipc,broadcast --repeats 2
    else  # one rank and one engine sharing the GPU: the hybrid engine's ipc
      step weight_sync 90 $PY benchmarks/weight_sync.py --suite transports --transports ipc --buckets 64,256 --repeats 3
    fi
    for layout in all none; do
      if [ "$layout" = none ] && [ "$gpus" -lt 3 ]; then  # actor, reference and engine on a GPU each
        echo "{\"grpo_step\": \"grpo-none\", \"skipped\": \"separate roles need 3 GPUs, $gpus here\"}"
        continue
      fi
      step "grpo_step_colocate_$layout" 90 .venv/bin/elasticrl run examples/tiny_grpo.yaml --output "$OUT/grpo-$layout" \
        --set world.model_size=50m --set rl.num_steps=2 --set eval.enabled=false --set placement.colocate=$layout \
        --set train.num_ranks=1 --set rollout.num_engines=1
      $PY - "$OUT/grpo-$layout/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"time/' in line]
last = rows[-1] if rows else {}
print(json.dumps({"grpo_step": sys.argv[1].split("/")[-2], **{k: round(v, 3) for k, v in last.items()
                                                             if k.startswith("time/")}}))
EOF
    done
    ;;
  *) echo "usage: scripts/gpu_check.sh full|bare" >&2; exit 2 ;;
esac
exit $status
