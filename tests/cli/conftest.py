"""Fixtures of the command-line tests: the shared corpus under the name these tests use, and the
bad-input catalogue's runs (tests/cli/test_bad_input*.py), started two at a time in the background."""

from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from bad_input_runner import Inputs, Started, fingerprint, train_checkpoints


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
