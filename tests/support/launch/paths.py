"""Where the suite's files live, for tests that hand a path to a subprocess (probes run as
scripts, recipes and benchmarks run as a user runs them)."""

from pathlib import Path

PROBES = Path(__file__).resolve().parents[1] / "probes"  # the scripts tests start by path (tests/support/probes)
REPO_ROOT = PROBES.parents[2]
