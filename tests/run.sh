#!/usr/bin/env bash
# The whole test suite: creates/reuses ./.venv with the pinned stack on first use, then runs pytest.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -m "not slow"` or `-k checkpoint`).
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/venv.sh
exec python -m pytest tests "$@"
