# Sourced by the recipes after they set their knobs: stage banners, stage skipping, and the fairseq
# launchers every recipe uses. Requires the venv to be active (recipes/lib/venv.sh).

RECIPES=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
USER_DIR=$(python -m fairseq_moe_ext --user-dir)
FAIRSEQ_BIN=$(dirname "$(command -v python)")
# fairseq, hydra and fairscale print pages of deprecation warnings per process; the logs keep
# everything fairseq itself says.
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
export PYTHONUNBUFFERED=1
# One intra-op thread per worker: on a small machine the workers are the parallelism, and more
# threads per worker only makes them fight for cores.
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}

# bash's SECONDS counts from the start of the recipe, so stage 1 includes creating the venv.
_recipe_start=0
_stage_start=0
_stage_total=${STAGES:-?}

# stage N "title": a numbered banner with the time the previous stage took.
stage() {
  local elapsed=$((SECONDS - _stage_start))
  [ "$1" = 1 ] || echo "    (stage took ${elapsed}s)"
  _stage_start=$SECONDS
  printf '\n==> [%s/%s] %s\n' "$1" "$_stage_total" "$2"
}

finish() {
  echo "    (stage took $((SECONDS - _stage_start))s)"
  printf '\n==> done in %dm%02ds\n' $(((SECONDS - _recipe_start) / 60)) $(((SECONDS - _recipe_start) % 60))
}

# needs_run STAMP SIGNATURE: true when the step that writes STAMP has not run with SIGNATURE (its
# knobs, and its inputs' signatures). Re-running a recipe redoes only what a changed knob affects.
needs_run() {
  if [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; then
    echo "    up to date (remove $(dirname "$1") to redo)"
    return 1
  fi
  rm -f "$1"
  return 0
}

mark_done() { mkdir -p "$(dirname "$1")" && printf '%s' "$2" > "$1"; }

# fairseq_tool NAME ARGS...: fairseq-NAME from the venv.
fairseq_tool() {
  local name=$1; shift
  "$FAIRSEQ_BIN/fairseq-$name" "$@"
}

# train_workers N LOG ARGS...: fairseq-train on N CPU workers (torchrun + gloo), as the README
# documents; N=1 is a plain process. torchrun --standalone picks a free port, so several recipes
# (or tests) can run at once. Output goes to the terminal and to LOG.
train_workers() {
  local workers=$1 log=$2; shift 2
  mkdir -p "$(dirname "$log")"
  if [ "$workers" -gt 1 ]; then
    python -m torch.distributed.run --standalone --nproc_per_node "$workers" \
      "$FAIRSEQ_BIN/fairseq-train" "$@" --distributed-world-size "$workers" 2>&1 | tee "$log"
  else
    "$FAIRSEQ_BIN/fairseq-train" "$@" 2>&1 | tee "$log"
  fi
}
