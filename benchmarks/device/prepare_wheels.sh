#!/usr/bin/env bash
# Prepares here, in the ignored folder .whl/, the wheels the lent GPU machine lacks (CPython 3.12,
# x86-64, no network there): the pins of benchmarks/device/wheels.txt (cp312 manylinux wheels from
# the package index; `build` lines built from their sdist into pure-Python wheels) and this project
# as a wheel. Then checks the set (benchmarks/device/wheelset.py: tags, one version of each, size
# with the tree that travels under 64 MiB, every requirement carried or on the machine) and, unless
# --no-verify, proves it installs and imports as well as this machine allows:
#   1. pip's resolver for CPython 3.12 / manylinux_2_28 x86-64 picks every wheel from .whl alone;
#   2. a real CPython 3.12 (PY312, python3.12 on PATH, or pyenv's) installs the set with
#      --no-index --no-deps --target into a clean folder and imports what needs no torch there
#      (hydra, omegaconf, antlr4, bitarray, fairseq's compiled Cython modules against numpy; numpy,
#      PyYAML and packaging, which the machine has, go to a separate folder) and compiles every
#      Python file of the set and of the tree;
#   3. this machine's Python has the pinned versions installed, and, narrowed to the machine's
#      packages plus the set (benchmarks/device/device_site), imports fairseq and the plugin and
#      builds an MoE model through fairseq's parser and task, with one training step.
# Options: --clean (empty .whl/ first), --no-verify. Exit 1 on any problem.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
CLEAN=0 VERIFY=1
for arg in "$@"; do
    case $arg in
        --clean) CLEAN=1 ;;
        --no-verify) VERIFY=0 ;;
        *) echo "prepare_wheels: unknown option $arg (use --clean, --no-verify)" >&2; exit 1 ;;
    esac
done

cd "$(dirname "$0")/../.."
ROOT=$PWD
PYTHON=${PYTHON:-.venv/bin/python}
[[ -x "$PYTHON" ]] || PYTHON=python3
WHL=$ROOT/.whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
FOR_DEVICE=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")
PIP=("$PYTHON" -m pip --disable-pip-version-check -q)

git check-ignore -q .whl/x.whl || { echo "prepare_wheels: .whl/ is not ignored by git: add '.whl/' to .gitignore" >&2; exit 1; }
(( CLEAN )) && rm -rf "$WHL"
mkdir -p "$WHL"

# The pins: name==version [build]
while read -r spec how; do
    if [[ "$how" == build ]]; then
        echo "prepare_wheels: building $spec from its sdist into a pure-Python wheel"
        "${PIP[@]}" wheel --no-deps --no-binary :all: -w "$WHL" "$spec"
    else
        echo "prepare_wheels: downloading $spec for CPython 3.12 manylinux x86-64"
        "${PIP[@]}" download --no-deps "${FOR_DEVICE[@]}" -d "$WHL" "$spec"
    fi
done < <(sed 's/#.*//' benchmarks/device/wheels.txt | awk 'NF')

echo "prepare_wheels: building this project (fairseq-moe-ext) as a wheel"
rm -f "$WHL"/fairseq_moe_ext-*.whl
if ! "${PIP[@]}" wheel --no-deps --no-build-isolation -w "$WHL" . 2>/dev/null; then
    "${PIP[@]}" wheel --no-deps -w "$WHL" .
fi

"$PYTHON" benchmarks/device/wheelset.py "$WHL"
(( VERIFY )) || exit 0

WORK=$(mktemp -d -t prepare_wheels.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

echo "prepare_wheels: 1. pip resolves every wheel for CPython 3.12 / manylinux_2_28 x86-64 from .whl alone"
names=()
for wheel in "$WHL"/*.whl; do names+=("$(basename "$wheel" | cut -d- -f1)"); done
"$PYTHON" -m pip --disable-pip-version-check install --dry-run --ignore-installed --no-index --no-deps \
    --find-links "$WHL" "${FOR_DEVICE[@]}" --target "$WORK/dry" "${names[@]}" | grep -i "would install"

PY312=${PY312:-}
if [[ -z "$PY312" ]] && python3.12 -c '' 2>/dev/null; then
    PY312=$(command -v python3.12)
elif [[ -z "$PY312" ]]; then
    PY312=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1 || true)
fi
if [[ -n "$PY312" ]]; then
    echo "prepare_wheels: 2. $("$PY312" -V) installs the set with --no-index --no-deps --target, imports it"
    "$PY312" -m pip --disable-pip-version-check -q install --no-index --no-deps --no-compile --target "$WORK/site" "$WHL"/*.whl
    # What the GPU machine has and these imports need (numpy, PyYAML, packaging), apart from the set.
    "$PY312" -m pip --disable-pip-version-check -q install --no-deps --target "$WORK/machine" numpy pyyaml packaging
    PYTHONPATH="$WORK/site:$WORK/machine" "$PY312" -s benchmarks/device/import_carried.py "$WORK/site"
else
    echo "prepare_wheels: 2. SKIPPED: no CPython 3.12 here (set PY312=/path/to/python3.12)"
fi

echo "prepare_wheels: 3. $("$PYTHON" -V), narrowed to the machine's packages and the set, imports fairseq and the plugin"
"$PYTHON" benchmarks/device/wheelset.py --pins-installed
PYTHONPATH="$ROOT/benchmarks/device/device_site:$ROOT" DEVICE_SITE_MISSING=pytest PYTHONWARNINGS=ignore \
    "$PYTHON" benchmarks/device/oneshot_env.py --import-only 2>&1 | grep -E '^(ok|FAILED):'
(( PIPESTATUS[0] == 0 ))
echo "prepare_wheels: the set in .whl/ is whole; run the device command of README.md (GPU one-shot)"
