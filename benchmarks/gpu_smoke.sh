#!/usr/bin/env bash
# GPU smoke test of fairseq MoE training as users run it, on one node, in under 8 minutes:
#   1. 2-GPU torchrun training of moe_transformer_tiny over NCCL with --fp16, --bf16 and --amp, each
#      on legacy_ddp and c10d (30 updates on the tests' tiny generated corpus; the loss must fall);
#   2. one-process fairseq-generate from a 2-worker checkpoint set;
#   3. determinism: two runs with --moe-deterministic give bit-identical checkpoints;
#   4. benchmarks/grouped_mm_check.py (torch._grouped_mm experts against the loop in bf16);
#   5. benchmarks/gpu_check.sh (the MoE layer in bf16 at large shapes).
# Every step prints PASS/FAIL (or SKIP with the reason); the script exits 1 if any step failed, and 2
# when torch sees no CUDA device. GPUS (default: min(2, device count)) sets the workers; with 1 GPU the
# 2-worker cases run with 1 worker. DRY_RUN=1 runs the same pipeline on CPU (--cpu, gloo), skipping
# what fairseq cannot run there. WORK (default: a new temporary folder) keeps data, logs, checkpoints.
set -uo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    echo "usage: [GPUS=N] [DRY_RUN=1] [WORK=dir] bash benchmarks/gpu_smoke.sh"
    exit 0
fi

cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-.venv/bin/python}
[[ -x "$PYTHON" ]] || PYTHON=python
BIN=$(dirname "$(command -v "$PYTHON")")
DRY_RUN=${DRY_RUN:-0}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [[ "$DRY_RUN" == 1 ]]; then
    GPUS=${GPUS:-2}
    DEVICE_FLAGS=(--cpu)
    export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=
    echo "gpu_smoke: DRY_RUN=1: the pipeline on CPU with $GPUS gloo worker(s)"
else
    COUNT=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
    if [[ "$COUNT" == 0 ]]; then
        echo "gpu_smoke: torch sees no CUDA device; this check needs a GPU (DRY_RUN=1 runs the pipeline on CPU)" >&2
        exit 2
    fi
    GPUS=${GPUS:-$(( COUNT < 2 ? COUNT : 2 ))}
    DEVICE_FLAGS=()
    (( GPUS < 2 )) && echo "gpu_smoke: only $GPUS GPU: the 2-worker cases run with 1 worker"
fi
(( GPUS >= 1 )) || { echo "gpu_smoke: GPUS must be at least 1" >&2; exit 1; }

WORK=${WORK:-$(mktemp -d -t gpu_smoke.XXXXXX)}
mkdir -p "$WORK"
echo "gpu_smoke: workers=$GPUS, logs and checkpoints in $WORK"
FAILED=0

LIMIT=(timeout 300)  # every command of a step; a hung NCCL collective fails its step instead of the script

# step NAME COMMAND...: run, log to $WORK/NAME.log, print PASS or FAIL.
step() {
    local name=$1; shift
    local started=$SECONDS
    if "$@" >"$WORK/$name.log" 2>&1; then
        echo "PASS $name ($(( SECONDS - started ))s)"
    else
        echo "FAIL $name (exit $?, $(( SECONDS - started ))s; log: $WORK/$name.log)"
        tail -n 15 "$WORK/$name.log" | sed 's/^/    /'
        FAILED=1
    fi
}

skip() { echo "SKIP $1: $2"; }

corpus() {
    "${LIMIT[@]}" "$PYTHON" - "$WORK" <<'EOF'
import sys, types
from pathlib import Path
try:
    import pytest  # noqa: F401  (fairseq_helpers reports a failed fairseq-preprocess through pytest.fail)
except ImportError:
    def fail(message, pytrace=True):
        raise SystemExit(message)
    sys.modules["pytest"] = types.SimpleNamespace(fail=fail)
sys.path.insert(0, "tests")
from fairseq_helpers import preprocess_parallel, write_parallel_corpus
work = Path(sys.argv[1])
preprocess_parallel(write_parallel_corpus(work / "raw"), work / "bin")
EOF
}

# train SAVE_DIR FLAGS...: fairseq-train on $GPUS workers under torchrun, then check the loss fell.
train() {
    local save_dir=$1; shift
    local world=()
    (( GPUS > 1 )) && world=(--distributed-world-size "$GPUS")
    "${LIMIT[@]}" "$PYTHON" -m torch.distributed.run --nproc_per_node "$GPUS" --master_port "$(free_port)" "$BIN/fairseq-train" \
        "$WORK/bin" --user-dir "$ROOT/fairseq_moe_ext" "${DEVICE_FLAGS[@]}" --seed 1 --num-workers 0 \
        --arch moe_transformer_tiny --moe-expert-count 4 \
        --criterion moe_label_smoothed_cross_entropy --label-smoothing 0.1 \
        --optimizer adam --lr 3e-3 --max-tokens 300 --clip-norm 1.0 --max-update 30 \
        --save-dir "$save_dir" --no-epoch-checkpoints --log-format json --log-interval 5 "${world[@]}" "$@" \
        >"$save_dir.out" 2>&1
    local status=$?
    cat "$save_dir.out"
    (( status == 0 )) || return $status
    "$PYTHON" - "$save_dir.out" <<'EOF'
import re, sys, json
losses = [float(json.loads(m.group(1))["loss"]) for m in re.finditer(r"\| train_inner \| (\{.*\})", open(sys.argv[1]).read())]
print("train_inner losses:", losses)
sys.exit(0 if len(losses) >= 3 and losses[-1] < 0.9 * losses[0] else 1)
EOF
}

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

generate() {
    local output
    output=$("${LIMIT[@]}" "$PYTHON" -m fairseq_cli.generate "$WORK/bin" --user-dir "$ROOT/fairseq_moe_ext" "${DEVICE_FLAGS[@]}" \
        --path "$1/checkpoint_last.pt" --beam 2 --max-tokens 2000 --num-workers 0 2>&1)
    local status=$?
    echo "$output"
    (( status == 0 )) && [[ $(grep -c '^H-' <<<"$output") -ge 10 ]]
}

same_checkpoints() {
    "$PYTHON" - "$1" "$2" <<'EOF'
import glob, os, sys
import torch
from fairseq_moe_ext.checkpoint import CHECKPOINT_SAFE_GLOBALS
first, second = sys.argv[1:]
names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(first, "checkpoint_last*.pt")))
assert names, f"no checkpoint_last*.pt in {first}"
for name in names:
    with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):  # weights_only stays on
        a = torch.load(os.path.join(first, name), weights_only=True)["model"]
        b = torch.load(os.path.join(second, name), weights_only=True)["model"]
    assert a.keys() == b.keys(), name
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{name}: {len(differ)} tensors differ, first {differ[0]}"
    print(f"{name}: {len(a)} tensors bit-identical")
EOF
}

step corpus corpus

GENERATE_FROM=
for precision in fp16 bf16 amp; do
    for backend in legacy_ddp c10d; do
        name="train-$precision-$backend"
        if [[ "$DRY_RUN" == 1 && "$precision" == amp ]]; then
            skip "$name" "fairseq's --amp builds torch.cuda.amp.GradScaler, which disables itself without CUDA (it would train in fp32)"
            continue
        fi
        if [[ "$DRY_RUN" == 1 && "$precision" == fp16 && "$GPUS" == 1 ]]; then
            skip "$name" "one-worker --fp16 flattens gradients into a buffer on torch.cuda.current_device()"
            continue
        fi
        step "$name" train "$WORK/ck-$precision-$backend" --ddp-backend "$backend" "--$precision"
        if [[ -z "$GENERATE_FROM" && -e "$WORK/ck-$precision-$backend/checkpoint_last.set.json" ]]; then
            GENERATE_FROM="$WORK/ck-$precision-$backend"  # a 2-worker set: generate loads it whole
        fi
    done
done

[[ -z "$GENERATE_FROM" && -e "$WORK/ck-bf16-legacy_ddp/checkpoint_last.pt" ]] && GENERATE_FROM="$WORK/ck-bf16-legacy_ddp"
if [[ -n "$GENERATE_FROM" ]]; then
    step "generate-one-process-from-$(basename "$GENERATE_FROM")" generate "$GENERATE_FROM"
else
    echo "FAIL generate: no training run left a checkpoint"
    FAILED=1
fi

step determinism-run-1 train "$WORK/det-1" --ddp-backend legacy_ddp --moe-deterministic
step determinism-run-2 train "$WORK/det-2" --ddp-backend legacy_ddp --moe-deterministic
step determinism-bit-identical same_checkpoints "$WORK/det-1" "$WORK/det-2"

if [[ "$DRY_RUN" == 1 ]]; then
    step grouped-mm-vs-loop-cpu-dry-check "${LIMIT[@]}" "$PYTHON" benchmarks/grouped_mm_check.py --device cpu
else
    step grouped-mm-vs-loop "${LIMIT[@]}" "$PYTHON" benchmarks/grouped_mm_check.py
fi

if [[ "$DRY_RUN" == 1 ]]; then
    skip gpu_check "benchmarks/gpu_check.sh needs CUDA"
else
    step gpu_check "${LIMIT[@]}" bash benchmarks/gpu_check.sh
fi

if (( FAILED )); then
    echo "gpu_smoke: FAIL (logs in $WORK)"
    exit 1
fi
echo "gpu_smoke: PASS ($SECONDS s)"
