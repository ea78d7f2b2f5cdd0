"""The order in which the suite hands tests to its two pytest-xdist workers (tests/conftest.py).

The workers take work in collection order, so a long test collected last would decide the wall time
alone on one worker while the other idles: the longest slow tests and module groups go first.
"""

# Node id fragments ("file::test name prefix", or a file for a module group), longest first: the
# slowest of `bash tests/run.sh --durations 15` on a quiet 2-core machine (a07b940, 6 Dec 2026).
# tests/recipes/test_suite_order.py fails when a fragment stops naming a test.
# fmt: off
LONGEST_FIRST = (
    "test_fault_injection.py::test_eleven_seeded_sigkills",
    "test_gpu_scripts.py::test_the_cpu_dry_run",
    "test_recipes.py::test_main_job_tiny_mode",
    "test_recipes.py::test_python_stdlib_lm_quick_mode",
    "test_nccl_timeouts.py::test_other_workers_wait_for_rank_0",
    "test_recipes.py::test_wmt16_dry_run",
    "test_recipes.py::test_wikitext103_dry_run",
    "test_fully_sharded_cli.py",
    "test_multiworker_cli.py",
    "test_multiworker_sets_cli.py",
)
# fmt: on


def longest_first_rank(nodeid: str) -> int:
    """Where a test goes among the longest (0 first); every other test ranks after them all."""
    return next((i for i, part in enumerate(LONGEST_FIRST) if part in nodeid), len(LONGEST_FIRST))
