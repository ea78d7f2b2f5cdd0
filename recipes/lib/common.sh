# shellcheck shell=bash
# Sourced by every recipe right after it changes to the repository root: the command line of the
# real-data recipes, the knob defaults all recipes share, the environment stage every recipe starts
# with, stage banners, stage skipping, and the fairseq launchers. Sourcing it runs nothing that
# needs the venv; setup_environment creates and activates it, and the functions after it need it.

RECIPES=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# recipe_args "$@": the real-data recipes' command line. --dry-run (or TINY=1 in the environment)
# sets DRY_RUN=1; -h/--help prints the script's header comment (up to its `set -euo pipefail`) and
# exits 0; any other argument exits 2.
# shellcheck disable=SC2034  # the recipes read DRY_RUN
recipe_args() {
  DRY_RUN=${TINY:-0}
  local arg
  for arg in "$@"; do
    case $arg in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
      *) echo "$0: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
  done
}

# shared_knob_defaults: the defaults every recipe's header lists alike (each recipe sets EXPERTS).
shared_knob_defaults() {
  : "${TOPK:=2}" "${MOE_FREQ:=2}" "${CAPACITY_FACTOR:=1.25}" "${GATE_LOSS_WT:=0.01}" "${SEED:=1}"
}

# setup_environment: the work of stage 1 (the recipe prints its banner): creates or reuses the venv
# (recipes/lib/venv.sh) and activates it, finds the plugin and fairseq's commands, sets the process
# environment of every later stage, and creates WORK and makes it absolute.
setup_environment() {
  # shellcheck source=recipes/lib/venv.sh
  source "$RECIPES/lib/venv.sh"
  # shellcheck disable=SC2034  # the recipes pass it to fairseq
  # MOE_USER_DIR: another checkout's plugin to run with (benchmarks/main_job_wall.py times two side by side).
  USER_DIR=${MOE_USER_DIR:-$(python -m fairseq_moe_ext --user-dir)}
  FAIRSEQ_BIN=$(dirname "$(command -v python)")
  # fairseq, hydra and fairscale print pages of deprecation warnings per process; the logs keep
  # everything fairseq itself says.
  export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
  export PYTHONUNBUFFERED=1
  # One intra-op thread per worker: on a small machine the workers are the parallelism, and more
  # threads per worker only makes them fight for cores.
  export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
  mkdir -p "$WORK"
  WORK=$(cd "$WORK" && pwd)
}

# bash's SECONDS counts from the start of the recipe, so stage 1 includes creating the venv.
_recipe_start=0
_stage_start=0

# stage N "title": a numbered banner with the time the previous stage took.
stage() {
  local elapsed=$((SECONDS - _stage_start))
  [ "$1" = 1 ] || echo "    (stage took ${elapsed}s)"
  _stage_start=$SECONDS
  printf '\n==> [%s/%s] %s\n' "$1" "${STAGES:-?}" "$2"
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

# made_for DIR SIGNATURE: for a DIR whose steps keep their outputs by name (an output that exists is not made
# again): emptied when it was made for another SIGNATURE (another teacher, metric, beam). A DIR older than its stamp
# (DIR/.made_for) is taken as made for SIGNATURE, as it was then.
made_for() {
  [ ! -d "$1" ] || [ -f "$1/.made_for" ] || mark_done "$1/.made_for" "$2"
  if needs_run "$1/.made_for" "$2"; then
    rm -rf "$1"
    mark_done "$1/.made_for" "$2"
  fi
}

# fairseq_examples: the examples/ directory of the installed fairseq package (its data scripts).
fairseq_examples() {
  python -c 'import fairseq, os; print(os.path.join(os.path.dirname(fairseq.__file__), "examples"))'
}

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
