#!/usr/bin/env bash
# The whole test suite: creates/reuses ./.venv with the pinned stack on first use, then runs pytest.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -m "not slow"` or `-k checkpoint`).
# Two pytest-xdist workers (MOE_TEST_WORKERS=N to change, 0 for one process); tests that share a
# module-scoped fixture stay on one worker (tests/conftest.py adds their xdist_group).
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/venv.sh
exec python -m pytest tests -n "${MOE_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
