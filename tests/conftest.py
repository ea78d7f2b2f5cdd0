"""Suite-wide set-up: thread counts, the shared tiny corpora, and how pytest-xdist spreads tests.

``bash tests/run.sh`` runs the suite on two pytest-xdist workers with ``--dist loadgroup``. A test
that uses a module- or class-scoped fixture (a trained run, a reference run) is kept on one worker
with every other test of its module that does (``xdist_group`` named after the module, added
below), so that the fixture is computed once; every other test goes wherever a worker is free.
Slow tests are handed out first, so that the longest ones do not start last.
"""

import os
import sys

import pytest
import torch

# Helpers, oracles and probes live in tests/support: `from fairseq_helpers import ...` finds them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
# Two cores: one intra-op thread per xdist worker, two when the suite runs in one process.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="session")
def parallel_data(tmp_path_factory):
    """fairseq-preprocess'ed tests/support/fairseq_helpers.write_parallel_corpus (seed 0), shared by every
    test of the session that only reads it (training, generation). Preprocessed in this process."""
    from fairseq_helpers import preprocess_in_process, write_parallel_corpus

    root = tmp_path_factory.mktemp("parallel_data")
    return preprocess_in_process(write_parallel_corpus(root / "raw"), root / "bin")


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory):
    """fairseq-preprocess'ed tests/support/fairseq_helpers.write_lm_corpus (seed 0), shared read-only."""
    from fairseq_helpers import preprocess_in_process, write_lm_corpus

    root = tmp_path_factory.mktemp("lm_data")
    return preprocess_in_process(write_lm_corpus(root / "raw"), root / "bin", language_model=True)


def _shares_a_module_fixture(item) -> bool:
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:
        return False
    return any(
        d.scope in ("module", "class", "package") for defs in definitions.name2fixturedefs.values() for d in defs
    )


def pytest_itemcollected(item):
    if _shares_a_module_fixture(item) and not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_collection_modifyitems(config, items):
    # xdist 3.8's loadgroup tells groups by a "@group" suffix that it writes into item._nodeid,
    # which pytest 9.2 no longer reads (the node id lives in item._id): write it there instead.
    if config.getoption("dist", default="no") == "loadgroup":
        from _pytest.nodeid import coerce_node_id

        for item in items:
            mark = item.get_closest_marker("xdist_group")
            if mark and "@" not in item.nodeid:
                item._id = coerce_node_id(f"{item.nodeid}@{mark.args[0] if mark.args else mark.kwargs['name']}")
    # Slow tests first, the longest of them first (LONGEST_FIRST), then groups before single tests; the
    # order within a module is kept. The workers take work in this order, so a long test handed out
    # last would decide the wall time alone on one worker while the other idles.
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            next((i for i, part in enumerate(LONGEST_FIRST) if part in item.nodeid), len(LONGEST_FIRST)),
            item.get_closest_marker("xdist_group") is None,
        )
    )


# The longest slow tests and module groups (measured on a quiet 2-core machine, longest first): node
# id fragments. Each is about a minute of one worker; the tests/recipes ones would otherwise be
# collected, and so started, last.
# fmt: off
LONGEST_FIRST = (
    "test_fault_injection.py::test_eleven_seeded_sigkills",
    "test_gpu_scripts.py::test_the_cpu_dry_run",
    "test_recipes.py::test_main_job_tiny_mode",
    "test_recipes.py::test_python_stdlib_lm_quick_mode",
    "test_multiworker_training_cli.py::test_four_workers_with_two_experts",
    "test_multiworker_training_cli.py::test_eval_lm_scores",
    "test_fully_sharded_cli.py",
    "test_multiworker_cli.py",
)
# fmt: on
