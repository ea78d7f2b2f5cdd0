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

# What tests share lives in tests/support, one package per kind (oracles/, inputs/, launch/, probes/; see
# docs/testing.md), imported by its kind: `from support.launch.fairseq_helpers import ...`. tests/ is what
# puts `support` on sys.path (pytest puts the folder of this conftest there too; workers inherit sys.path).
# tests/repo/test_house_rules.py keeps tests/support to folders and every import of it to its package path.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from support.launch.suite_order import hands_out_by_group, longest_first_rank  # noqa: E402


def pytest_configure(config):
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        return  # pytest-xdist's controller, which runs no test: it need not import torch (2 s of CPU)
    import torch

    # One intra-op thread for in-process tests, in one process (MOE_TEST_WORKERS=0) as on each of the two
    # xdist workers: their tensors are tiny, and a second thread on a loaded machine burns CPU spinning, so
    # a test timed alone would read dearer than in the suite. MOE_TEST_TORCH_THREADS=N for another count.
    torch.set_num_threads(int(os.environ.get("MOE_TEST_TORCH_THREADS") or 1))


@pytest.fixture(autouse=True)
def _seeded():
    import torch

    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="session")
def parallel_data(tmp_path_factory):
    """fairseq-preprocess'ed tests/support/launch/fairseq_helpers.write_parallel_corpus (seed 0), shared by every
    test of the session that only reads it (training, generation). Preprocessed in this process."""
    from support.launch.fairseq_helpers import preprocess_in_process, write_parallel_corpus

    root = tmp_path_factory.mktemp("parallel_data")
    return preprocess_in_process(write_parallel_corpus(root / "raw"), root / "bin")


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory):
    """fairseq-preprocess'ed tests/support/launch/fairseq_helpers.write_lm_corpus (seed 0), shared read-only."""
    from support.launch.fairseq_helpers import preprocess_in_process, write_lm_corpus

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
    # which pytest 9.2 no longer reads (the node id lives in item._id): write it there instead. On the
    # workers, where the suffix counts, --dist reads "no" (until 7 Dec 2026 no group reached the scheduler).
    if hands_out_by_group(config):
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
            longest_first_rank(item.nodeid),
            item.get_closest_marker("xdist_group") is None,
        )
    )
