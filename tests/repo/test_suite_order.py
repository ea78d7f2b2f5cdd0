"""The suite's hand-out order names tests that exist (a renamed test would silently lose its place)."""

import re
from pathlib import Path

import pytest

from support.launch.suite_order import LONGEST_FIRST, longest_first_rank

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fragment", LONGEST_FIRST)
def test_every_longest_first_fragment_names_a_test_file_and_a_test_in_it(fragment):
    file_name, _, name_prefix = fragment.partition("::")
    files = sorted(TESTS.rglob(file_name))
    assert len(files) == 1, f"{fragment}: {len(files)} files named {file_name} under tests/"
    if name_prefix:
        defined = re.findall(rf"^def ({re.escape(name_prefix)}\w*)\(", files[0].read_text(), re.M)
        assert defined, f"{fragment}: no test in {files[0].name} starts with {name_prefix}"


def test_the_longest_tests_rank_in_the_listed_order_and_the_rest_after_them():
    ids = ["tests/recipes/test_recipes.py::test_main_job_tiny_mode_trains", "tests/core/test_moe_core.py::test_x"]
    assert longest_first_rank(ids[0]) == LONGEST_FIRST.index("test_recipes.py::test_main_job_tiny_mode")
    assert longest_first_rank(ids[1]) == len(LONGEST_FIRST)


@pytest.fixture(scope="module")
def shared_by_the_module():
    return object()


def test_a_test_sharing_a_module_fixture_carries_its_xdist_group_where_groups_are_handed_out(
    shared_by_the_module, request
):
    """On an xdist worker of ``--dist loadgroup`` (tests/run.sh) the node id the scheduler reads ends in
    "@<group>": without it, a module-scoped fixture is computed on both workers."""
    worker = getattr(request.config, "workerinput", None)
    if worker is None or "loadgroup" not in " ".join(worker["mainargv"]):
        pytest.skip("not on a worker of a --dist loadgroup run (one process hands out nothing)")
    assert request.node.nodeid.endswith(f"@{request.module.__name__}"), request.node.nodeid
