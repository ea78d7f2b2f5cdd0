#!/usr/bin/env bash
# One short GPU check: the MoE layer in bf16 at large shapes (d_model 2048, H 8192, E 64, k 2,
# 65536 tokens), forward+backward, as TFLOP/s against the floor (one dense FFN doing the same
# FLOPs: the same GEMM work without routing) and a dense FFN with the same active parameters.
# MoE rows: "moe" uses the kernel picked by auto (torch._grouped_mm on sm90+ in bf16), "moe[loop]"
# one GEMM per expert. Extra arguments go to benchmarks/moe_layer.py (e.g. --tokens 16384).
# Exits 2 with a message when torch sees no CUDA device. Takes about a minute on an H100/H200.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    echo "usage: bash benchmarks/gpu_check.sh [moe_layer.py options]"
    exit 0
fi

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[[ -x "$PYTHON" ]] || PYTHON=python

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch ($("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')) sees no CUDA device; this check needs a GPU" >&2
    exit 2
fi

exec "$PYTHON" benchmarks/moe_layer.py --device cuda --dtype bf16 \
    --d-model 2048 --hidden 8192 --experts 64 --top-k 2 --tokens 65536 \
    --expert-matmul auto,loop --no-sweep --no-memory --no-fairscale --reps 5 --warmup 2 "$@"
