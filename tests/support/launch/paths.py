"""Where the suite's files live, for tests that hand a path to a subprocess (probes run as
scripts, recipes and benchmarks run as a user runs them)."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # helpers, oracles and the probe entry points
REPO_ROOT = SUPPORT.parents[1]
