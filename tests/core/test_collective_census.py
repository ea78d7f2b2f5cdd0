"""The MoE layer's collectives and host syncs per call, by mode, on 2 workers: a count that grows fails.

Counted by ``fairseq_moe_ext.moe.census.Census`` (torch.distributed's functions wrapped, so whatever reaches
torch is counted) on 2 workers as threads with real collectives (``thread_world``), through the same harness
the layer benchmark prints (``recipes/layer_census.py``). docs/performance.md, "Collectives and host syncs per
layer call", holds the same table.
"""

import sys

import pytest
import torch
import torch.distributed as dist

from fairseq_moe_ext.moe.census import Census
from support.launch.paths import REPO_ROOT
from support.launch.thread_world import ThreadWorld

sys.path.insert(0, str(REPO_ROOT / "recipes"))
from layer_census import EXPECTED as CENSUS  # noqa: E402
from layer_census import MODES, census_of_modes  # noqa: E402


@pytest.fixture(scope="module")
def counted():
    with pytest.MonkeyPatch.context() as monkeypatch:
        world = ThreadWorld(2).install(monkeypatch)
        return world.run(lambda rank: census_of_modes(world.world_group, rank))


def test_the_census_table_names_every_mode_the_harness_counts():
    assert set(CENSUS) == {*MODES, "criterion, per forward", "balance-bias update, per step"}


@pytest.mark.parametrize("mode", list(CENSUS))
def test_each_worker_issues_the_layer_calls_collectives_and_host_syncs_of_the_census(counted, mode):
    for rank, by_mode in enumerate(counted):
        found = by_mode[mode]
        got = (found.forward, found.backward, found.forward_syncs, found.backward_syncs)
        assert got == CENSUS[mode], f"rank {rank}, {mode}: (forward, backward, syncs) {got}\n{found.sites}"


def test_the_census_counts_every_collective_that_reaches_torch_on_its_own_thread_only(monkeypatch):
    world = ThreadWorld(2).install(monkeypatch)

    def on_rank(rank):
        t = torch.ones(3)
        with Census() as census:
            dist.all_reduce(t)
            if rank == 1:
                dist.all_gather([torch.empty(3), torch.empty(3)], t)
                out = torch.empty(4)
                dist.all_to_all_single(out, torch.arange(4.0), [2, 2], [2, 2])
            t.tolist()
        if rank == 0:
            dist.all_gather([torch.empty(3), torch.empty(3)], t)  # outside the census
            out = torch.empty(4)
            dist.all_to_all_single(out, torch.arange(4.0), [2, 2], [2, 2])
        return [(c.op, c.group_size, c.nbytes) for c in census.collectives], census.count

    (ops0, syncs0), (ops1, syncs1) = world.run(on_rank)
    assert ops0 == [("all_reduce", 2, 12)] and syncs0 == 1
    assert ops1 == [("all_reduce", 2, 12), ("all_gather", 2, 36), ("all_to_all_single", 2, 32)] and syncs1 == 1
