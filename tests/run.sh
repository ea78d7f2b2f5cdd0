#!/usr/bin/env bash
# The test suite: creates/reuses ./.venv with the pinned stack on first use, then runs pytest.
#   bash tests/run.sh                         # the whole suite (what CI runs)
#   bash tests/run.sh --fast                  # the fast specification tests only (-m "not slow")
#   bash tests/run.sh tests/core tests/cli/test_bad_input.py -k resume   # these paths instead of tests/
# Other arguments go to pytest. Two pytest-xdist workers (MOE_TEST_WORKERS=N to change, 0 for one
# process); tests that share a module-scoped fixture stay on one worker (tests/conftest.py adds their
# xdist_group). At the end it prints the wall time and the CPU time (user + sys of pytest and every
# process it started), so that a figure taken on a loaded machine can still be compared. Without
# paths (the whole suite, or --fast) it first runs the formatter check and the linter (ruff, settings in
# pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/venv.sh

args=()
paths=()
previous=""
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then
    args+=(-m "not slow")
  elif [[ "$arg" != -* ]] && [[ ! "$previous" =~ ^(-k|-m|-n|-p|-o|-c|--basetemp|--rootdir|--dist|--durations)$ ]] \
      && [ -e "${arg%%::*}" ]; then
    paths+=("$arg")  # a file, directory or node id: run it instead of the whole tests/
  else
    args+=("$arg")
  fi
  previous=$arg
done
if [ ${#paths[@]} -eq 0 ]; then
  paths=(tests)
  ruff format --check --quiet . || { echo "[tests/run.sh] ruff format would change the files above: run \`ruff format .\` (settings: pyproject.toml)" >&2; exit 1; }
  ruff check --quiet . || { echo "[tests/run.sh] ruff check found the problems above (settings: pyproject.toml)" >&2; exit 1; }
fi

# Bytecode is written and reused: where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), each of the
# suite's hundreds of Python processes (fairseq launches, torchrun workers, probes) compiled the plugin from source
# again (about 0.45 s of CPU each on 2 cores, the plugin alone) and each pytest worker rewrote every test module.
# __pycache__ is ignored by git.
unset PYTHONDONTWRITEBYTECODE
started=$(date +%s.%N)
status=0
python -m pytest "${paths[@]}" -n "${MOE_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder \
  ${args[@]+"${args[@]}"} || status=$?
finished=$(date +%s.%N)
# `times` (run in this shell, not a subshell): this shell's user and sys, then those of its waited-for
# children (pytest, its xdist workers and every process they waited for), each as XmY.YYYs.
usage=$(mktemp)
times > "$usage"
awk -v started="$started" -v finished="$finished" '
  function seconds(t) { split(t, p, "m"); sub("s", "", p[2]); return p[1] * 60 + p[2] }
  NR == 2 { user = seconds($1); sys = seconds($2) }
  END { printf "[tests/run.sh] wall %.0f s, CPU %.0f s (user %.0f + sys %.0f)\n", finished - started, user + sys, user, sys }
' "$usage" >&2
rm -f "$usage"
exit "$status"
