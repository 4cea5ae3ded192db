#!/usr/bin/env bash
# What one GPU can show of the accelerator path, in one run (about four minutes on an H100):
#   1. the tests that run wherever CUDA is: the device layer, NCCL groups with their gloo twins
#      and the backend abort, snapshots copied from device memory on a side stream, the NVML
#      governor read from the real GPU (read-only: no clock is changed);
#   2. megatron-core on CUDA for one rank through elaswave-run, with --elastic, and again with a
#      step that raises and runs again from its snapshot: the two runs must agree;
#   3. the per-step snapshots' cost against none on that rank (scripts/bench/snapshot.py);
#   4. an MoE model (8 experts, top-2, the alltoall dispatcher on its CUDA stream and event, a
#      shared expert, aux-loss-free routing) on that rank with --elastic, and again with a step
#      that raises and runs again from its device snapshot (the experts and the routers' expert
#      biases restored): the two runs must agree; where Transformer Engine imports, the same
#      with its grouped GEMM experts (--moe-grouped-gemm, TEGroupedMLP).
# Several NCCL ranks cannot share one GPU: the multi-rank elastic path on NCCL is covered by the
# CPU tests that run the same code with separate host and device groups; MoE with tensor
# parallelism (sequence parallelism, expert parallelism inside the TP group) by tests/test_moe.py
# on CPU.
#
# Usage: bash scripts/gpu_check.sh [OUT_DIR]
# Runs on the python3 on PATH and keeps its torch (a CUDA build); installs megatron-core and
# this package without dependencies into OUT_DIR/packages. Offline, point PIP_FIND_LINKS at a folder
# of wheels (megatron-core's).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONUNBUFFERED=1

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device is visible to $PYTHON (torch with CUDA needed)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", ".".join(map(str, torch.cuda.nccl.version())))' | tee -a "$OUT/gpu.txt"

index=()
[ -n "${PIP_FIND_LINKS:-}" ] && index=(--no-index)
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --target "$OUT/packages" "${index[@]}" \
    'megatron-core>=0.16.1,<0.20' . || { echo "gpu_check: installation failed" >&2; exit 1; }
export PYTHONPATH="$OUT/packages"
REPO=$PWD
cd "$OUT"  # the checkout's megatron_elaswave/ lacks the installed patches sub-package

status=0
step() {  # step NAME COMMAND...: run (15 min at most), log to OUT/NAME.log, remember a failure
    local name=$1; shift
    echo "== $name"
    timeout 900 "$@" 2>&1 | tee "$OUT/$name.log"
    local code=${PIPESTATUS[0]}
    echo "== $name: exit $code"
    [ "$code" -eq 0 ] || status=1
}

step tests "$PYTHON" -m pytest -q -p no:cacheprovider \
    "$REPO"/tests/test_{accelerator_path,snapshot,device,dvfs}.py

GPT=(--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
     --micro-batch-size 4 --global-batch-size 16 --lr 1e-4 --mock-data --vocab-size 32000
     --use-distributed-optimizer --bf16 --log-interval 5 --eval-interval 100000)
step elastic_run "$PYTHON" -m megatron_elaswave.launch.run --nproc-per-node=1 "$REPO/scripts/pretrain_gpt.py" \
    "${GPT[@]}" --train-iters 20 --elastic --elastic-metrics-file "$OUT/elastic_metrics.jsonl"
# A step that raises on the GPU is run again from the snapshot restored into device memory.
step elastic_rerun "$PYTHON" -m megatron_elaswave.launch.run --nproc-per-node=1 \
    "$REPO/scripts/pretrain_gpt.py" "${GPT[@]}" --train-iters 20 --elastic \
    --elastic-inject-failure rank=0,iteration=8,kind=raise \
    --elastic-metrics-file "$OUT/elastic_rerun_metrics.jsonl"
step rerun_on_trajectory "$PYTHON" - "$OUT/elastic_metrics.jsonl" "$OUT/elastic_rerun_metrics.jsonl" <<'PY'
import json, sys
runs = [[r for r in map(json.loads, open(path)) if r["event"] == "iteration"] for path in sys.argv[1:]]
assert [r["iteration"] for r in runs[0]] == [r["iteration"] for r in runs[1]] == list(range(1, 21))
assert all(a["samples_digest"] == b["samples_digest"] for a, b in zip(*runs))
worst = max(abs(a["lm_loss"] - b["lm_loss"]) / abs(a["lm_loss"]) for a, b in zip(*runs))
print(f"rerun from a device snapshot: same samples in all 20 iterations, largest relative loss "
      f"difference {worst:.2e}; step time median {sorted(r['step_time_s'] for r in runs[0])[10]:.4f} s")
sys.exit(0 if worst <= 1e-4 else 1)
PY

MOE=(--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --disable-bias-linear
     --moe-shared-expert-intermediate-size 1024 --moe-router-score-function sigmoid
     --moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss
     --moe-aux-loss-coeff 1e-4)
moe_run() {  # moe_run NAME SCRIPT FLAGS...: 20 iterations with --elastic, then with a re-run
    local name=$1; shift
    step "$name" "$PYTHON" -m megatron_elaswave.launch.run --nproc-per-node=1 "$@" \
        --train-iters 20 --elastic --elastic-metrics-file "$OUT/${name}_metrics.jsonl"
    step "${name}_rerun" "$PYTHON" -m megatron_elaswave.launch.run --nproc-per-node=1 "$@" \
        --train-iters 20 --elastic --elastic-inject-failure rank=0,iteration=8,kind=raise \
        --elastic-metrics-file "$OUT/${name}_rerun_metrics.jsonl"
    step "${name}_on_trajectory" "$PYTHON" - "$OUT/${name}_metrics.jsonl" \
        "$OUT/${name}_rerun_metrics.jsonl" <<'PY'
import json, sys
runs = [[r for r in map(json.loads, open(path)) if r["event"] == "iteration"] for path in sys.argv[1:]]
assert [r["iteration"] for r in runs[0]] == [r["iteration"] for r in runs[1]] == list(range(1, 21))
assert all(a["samples_digest"] == b["samples_digest"] for a, b in zip(*runs))
worst = max(abs(a["lm_loss"] - b["lm_loss"]) / abs(a["lm_loss"]) for a, b in zip(*runs))
balance = [r["moe_losses"]["seq_load_balancing_loss"] for r in runs[1]]
print(f"MoE rerun from a device snapshot: largest relative loss difference {worst:.2e}, "
      f"seq-aux loss {balance[0]:.4f} -> {balance[-1]:.4f}")
sys.exit(0 if worst <= 1e-4 else 1)
PY
}
moe_run moe_sequential "$REPO/scripts/pretrain_gpt.py" "${GPT[@]}" "${MOE[@]}"
# Transformer Engine's grouped-GEMM experts, in Megatron-LM's loop (the training package of a
# megatron-core 0.19 wheel), where both import.
if "$PYTHON" -c 'import transformer_engine, megatron.training.training' 2>/dev/null; then
    moe_run moe_grouped_gemm -m megatron_elaswave.run_megatron_lm \
        "$REPO/tests/megatron_lm_pretrain_gpt.py" "${GPT[@]}" "${MOE[@]}" \
        --tokenizer-type NullTokenizer --max-position-embeddings 1024 \
        --transformer-impl transformer_engine --moe-grouped-gemm --eval-iters 0
else
    echo "== moe_grouped_gemm: skipped, Transformer Engine or Megatron-LM's training package does not import"
fi

step snapshot_cost "$PYTHON" "$REPO/scripts/bench/snapshot.py" --nproc 1 --pp 1 --num-layers 4 \
    --hidden-size 1024 --seq-length 1024 --micro-batch-size 4 --global-batch-size 16 --bf16 \
    --train-iters 30 --warmup-iters 5 --rounds 1

exit $status
