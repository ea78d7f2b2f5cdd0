"""Fixtures of the command-line tests: the shared corpus under the name these tests use, and the
bad-input catalogue's runs (tests/cli/test_bad_input*.py), started two at a time in the background."""

import shutil
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from support.launch.bad_input_runner import Inputs, Started, fingerprint, train_checkpoints
from support.launch.fairseq_helpers import torchrun
from support.launch.multiworker_cli_runs import generate, moe_args
from support.launch.paths import PROBES

TRAIN_EVERY_DIGIT = PROBES / "fairseq_train_every_digit.py"  # fairseq-train logging unrounded losses


@pytest.fixture(scope="session")
def data(parallel_data):
    """The session's shared preprocessed parallel corpus (tests/conftest.py), read only."""
    return parallel_data


# ---------------------------------------------------------------- the bad-input catalogue's runs
# Module-scoped: each catalogue module gets its own pool, trained inputs and runs of its own table.


@pytest.fixture(scope="module")
def pool():
    """Where the runs go: two at a time, one per core."""
    executor = ThreadPoolExecutor(max_workers=2)
    yield executor
    executor.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def bad_input_data(parallel_data, lm_data) -> Inputs:
    return Inputs(data=parallel_data, lm_data=lm_data)


@pytest.fixture(scope="module")
def checkpoints(pool, bad_input_data, tmp_path_factory) -> Future:
    """Inputs with trained checkpoints, once the training started here has finished."""
    return pool.submit(train_checkpoints, bad_input_data, tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def started(request, pool, bad_input_data, tmp_path_factory):
    """Prepare and start every selected case of the requesting module's CASES: {case id: Started}."""
    wanted = {
        item.callspec.params["case"].id
        for item in request.session.items
        if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})
    }
    cases = [c for c in request.module.CASES if c.id in wanted]
    trained = request.getfixturevalue("checkpoints") if any(c.needs_checkpoints for c in cases) else None
    root = tmp_path_factory.mktemp("cases")
    runs = {}
    for case in sorted(cases, key=lambda c: c.needs_checkpoints):  # those that need only data go first
        work = root / case.id
        work.mkdir()
        args, watched = case.make(trained.result() if case.needs_checkpoints else bad_input_data, work)
        runs[case.id] = Started(pool.submit(case.tool, args), watched, {d: fingerprint(d) for d in watched})
    return runs


# ---------------------------------------------------------------- one 2-worker run, shared
# Session-scoped and used by two modules (test_multiworker_cli.py, test_multiworker_sets_cli.py), which
# share the xdist_group "two_worker_run": one worker trains it once for both.


@pytest.fixture(scope="session")
def two_worker_run(data, tmp_path_factory):
    """A 2-worker run saved at update 4 (mid-epoch) and the same run uninterrupted to update 8. The
    uninterrupted one also saves a set every 2 updates and keeps the newest three (sets at 4, 6 and
    8): one run serves the resume, the pruning and the save-schedule tests."""
    root = tmp_path_factory.mktemp("sets")
    uninterrupted = torchrun(
        2,
        TRAIN_EVERY_DIGIT,
        moe_args(data, root / "full", 8, "--save-interval-updates", "2", "--keep-interval-updates", "3"),
    )
    torchrun(2, TRAIN_EVERY_DIGIT, moe_args(data, root / "ck", 4))
    snapshot = root / "at4"
    shutil.copytree(root / "ck", snapshot)
    return {"root": root, "save_dir": root / "ck", "at4": snapshot, "uninterrupted": uninterrupted}


@pytest.fixture(scope="session")
def at4_generation(two_worker_run, data):
    """One-process fairseq-generate from the set saved at update 4: (hypotheses, output), the
    reference of every test that compares a generation with it (generated once)."""
    return generate(data, two_worker_run["at4"] / "checkpoint_last.pt")
