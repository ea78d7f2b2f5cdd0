#!/usr/bin/env bash
# The one-shot GPU check for a lent machine (one GPU, about 8 minutes, files back only from $OUT):
# environment and plugin import; the MoE layer against an fp64 CPU reference, the precision matrix,
# grouped GEMM against the loop, a bitwise repeat; a one-rank NCCL group and two ranks sharing the
# GPU over cuda:gloo (emulation); the layer benchmark; fairseq on one GPU in fp32, --fp16, --bf16,
# --amp and a combined bf16 run, determinism, and beside them two-rank cuda:gloo runs (legacy_ddp,
# c10d, fully_sharded --bf16) and generation from the first.
# One line per result is appended to $OUT/summary.txt as it comes (PASS/FAIL/SKIP/INFO name: figures);
# once ONESHOT_DEADLINE_S (default 510) seconds have passed since the start, what is left says
# SKIP (deadline). $OUT gets summary.txt, figures.json and logs.tar.gz (no .pt files). Exit 1 if a
# line is FAIL, 2 when python3 or torch is missing (the summary says which).
# Wheels in .whl/ (ONESHOT_WHEELS; benchmarks/device/prepare_wheels.sh) are installed first with
# --no-index --no-deps --target, stopped after ONESHOT_WHEELS_TIMEOUT_S (default 120). Without CUDA
# (and not a dry run) only the environment step runs. Every line ends with [card: name, memory].
# figures.json and logs.tar.gz are rewritten after every check (a run cut off still brings them back);
# the fairseq check keeps 200 s that no earlier check may take.
# ONESHOT_DRY_RUN=1: the same checks on CPU with tiny sizes, under this machine's Python narrowed to
# the GPU machine's packages (benchmarks/device/device_site); CUDA-only parts say SKIP (cuda).
# ONESHOT_TIME_SCALE=F (dry run only, default 1): every limit and the deadline times F, for a CPU shared
# with other work (tests/recipes/test_gpu_scripts.py sets it from the load average).
# ONESHOT_ONLY=env,layer,... runs some checks; ONESHOT_WORK keeps the scratch folder. ONESHOT_PLANT=run=fault,...
# (dry run only) plants a fault in fairseq runs (benchmarks/device/oneshot_plant.py) to show the verdicts fail.
set -uo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    echo "usage: [ONESHOT_DRY_RUN=1] [ONESHOT_DEADLINE_S=510] [OUT=dir] bash benchmarks/gpu_oneshot.sh"
    exit 0
fi

cd "$(dirname "$0")/.."
ROOT=$PWD
export ONESHOT_STARTED=$(date +%s)
DRY_RUN=${ONESHOT_DRY_RUN:-0}
WHEELS=${ONESHOT_WHEELS:-.whl}
WHEELS_TIMEOUT=${ONESHOT_WHEELS_TIMEOUT_S:-120}
OUT=${OUT:-$ROOT/work-dirs/oneshot-out}
mkdir -p "$OUT"
: >"$OUT/summary.txt"
export ONESHOT_WORK=${ONESHOT_WORK:-$(mktemp -d -t oneshot.XXXXXX)}
mkdir -p "$ONESHOT_WORK/logs"
# Every line names the card it ran on (nvidia-smi's name and memory, asked once with a timeout).
if [[ "$DRY_RUN" == 1 ]]; then
    CARD="cpu, dry run"
elif CARD=$(timeout 20 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1) && [[ -n "$CARD" ]]; then
    :
else
    CARD="no GPU seen by nvidia-smi"
fi
export ONESHOT_CARD=$CARD
say() { echo "$* [card: $CARD]" | tee -a "$OUT/summary.txt"; }

if [[ "$DRY_RUN" == 1 ]]; then
    PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
    [[ -x "$PYTHON" ]] || PYTHON=python3
else
    PYTHON=${PYTHON:-python3}
fi
if tree=$(git rev-parse --short HEAD 2>/dev/null); then git diff --quiet HEAD 2>/dev/null || tree+="+changes"; else tree="?"; fi
say "INFO oneshot: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname 2>/dev/null || echo '?'), deadline ${ONESHOT_DEADLINE_S:-510}s, dry run $DRY_RUN${ONESHOT_TIME_SCALE:+ (time scale $ONESHOT_TIME_SCALE)}, tree $tree"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    say "FAIL environment: no '$PYTHON' on PATH (PATH=$PATH): nothing else can run; set PYTHON=/path/to/python3"
    exit 2
fi
if ! "$PYTHON" -c 'import torch' 2>"$ONESHOT_WORK/logs/torch-import.log"; then
    say "FAIL environment: $("$PYTHON" -V 2>&1) at $(command -v "$PYTHON") cannot import torch: $(tail -n 1 "$ONESHOT_WORK/logs/torch-import.log")"
    exit 2
fi

if [[ "$DRY_RUN" == 1 ]]; then
    # recipes/lib/lean_imports (run by device_site's sitecustomize) defers scikit-learn's import: start-up only.
    export PYTHONPATH="$ROOT/benchmarks/device/device_site:$ROOT/recipes/lib/lean_imports:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    export DEVICE_SITE_MISSING=${DEVICE_SITE_MISSING:-pytest} DEVICE_SITE_LOG="$ONESHOT_WORK/logs/refused-imports.txt"
    export CUDA_VISIBLE_DEVICES=
    # One intra-op thread per check: the dry run's tensors are toys, and on a CPU shared with other work
    # a second thread mostly spins (the checks' results do not depend on it).
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    say "SKIP wheels: (dry run) the cp312 set is not installed here; imports are narrowed to the GPU machine's packages and benchmarks/device/wheels.txt"
elif compgen -G "$WHEELS/*.whl" >/dev/null; then
    started=$SECONDS
    if timeout "$WHEELS_TIMEOUT" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$ONESHOT_WORK/site" "$WHEELS"/*.whl >"$ONESHOT_WORK/logs/wheels.log" 2>&1; then
        say "PASS wheels: $(ls "$WHEELS"/*.whl | wc -l) wheels installed with --no-index --no-deps --target in $(( SECONDS - started ))s"
    elif (( SECONDS - started >= WHEELS_TIMEOUT )); then
        say "FAIL wheels: pip install did not finish in ${WHEELS_TIMEOUT}s (ONESHOT_WHEELS_TIMEOUT_S), stopped: $(tail -n 1 "$ONESHOT_WORK/logs/wheels.log")"
    else
        say "FAIL wheels: pip install --no-index --no-deps failed: $(tail -n 1 "$ONESHOT_WORK/logs/wheels.log")"
    fi
    # The tree under test comes first; the installed set supplies fairseq, hydra, omegaconf, ...
    export PYTHONPATH="$ROOT:$ONESHOT_WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
    say "INFO wheels: no $WHEELS/*.whl travelled (carry .whl after benchmarks/device/prepare_wheels.sh); using what $PYTHON has"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

export ONESHOT_OUT=$OUT ONESHOT_DRY_RUN=$DRY_RUN PYTHONUNBUFFERED=1
"$PYTHON" benchmarks/device/oneshot.py
