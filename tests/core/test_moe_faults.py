"""Faults in the MoE core: dead or stalled peers, workers that disagree, and determinism.

A worker that dies or hangs must never leave its peers waiting forever inside an MoE collective;
they fail within a bounded time with an error that says what happened and what to do.
"""

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig, comm, grouped_mm
from support.launch.dist_utils import run_workers_through_faults

D, H = 8, 16


def layer_for(group, experts=4, **kwargs):
    torch.manual_seed(0)
    return MoELayer(MoELayerConfig.of(D, H, experts, k=2, **kwargs), seed=5, group=group)


def train_steps(layer, steps, before_step=lambda step: None):
    x = torch.randn(24, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(steps):
        before_step(step)
        layer(x).square().sum().backward()


def die_now(mark_file):
    with open(mark_file, "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def peer_dies(rank, world, mark_file, where):
    layer = layer_for(dist.new_group([0, 1], timeout=timedelta(seconds=60)))
    if rank == 1 and where == "before its step":
        train_steps(layer, 3, before_step=lambda step: step == 1 and die_now(mark_file))
        return
    if rank == 1 and where == "between the forward and backward all-to-alls":
        calls = [0]
        real = comm._all_to_all

        def all_to_all_then_die(*args):
            calls[0] += 1
            if calls[0] == 7:  # step 1: forward sends and returns rows (calls 5, 6), backward's first
                die_now(mark_file)
            return real(*args)

        comm._all_to_all = all_to_all_then_die
    train_steps(layer, 3)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before its step", "between the forward and backward all-to-alls"])
def test_a_peer_that_dies_fails_the_survivor_within_seconds_with_a_clear_error(tmp_path, where):
    mark = tmp_path / "died_at"
    survivor, victim = run_workers_through_faults(peer_dies, 2, str(mark), where, deadline=90)
    assert victim is None and mark.exists(), victim
    assert survivor is not None and survivor.get("error") == "MoECommunicationError", survivor
    assert survivor["at"] - float(mark.read_text()) < 30
    message = survivor["message"]
    assert "a peer worker died or stalled" in message and "restart the job with the same command" in message
    assert "\n" not in message


def peer_stalls(rank, world, timeout_s, mark_file):
    layer = layer_for(dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s)))

    def stall(step):
        if rank == 1 and step == 1:
            with open(mark_file, "w") as f:
                f.write(repr(time.monotonic()))
            time.sleep(4 * timeout_s)  # then it carries on and finds its peer gone

    train_steps(layer, 3, before_step=stall)


@pytest.mark.slow
def test_a_peer_that_stalls_fails_the_survivor_after_the_comm_timeout_not_never(tmp_path):
    mark = tmp_path / "stalled_at"
    survivor, stalled = run_workers_through_faults(peer_stalls, 2, 3.0, str(mark), deadline=90)
    assert survivor is not None and survivor.get("error") == "MoECommunicationError", survivor
    waited = survivor["at"] - float(mark.read_text())
    assert 2.5 < waited < 11, waited  # the 3 s timeout, not the stalled peer's return after 12 s
    assert "--moe-comm-timeout" in survivor["message"] and "\n" not in survivor["message"]
    assert stalled is not None and stalled.get("error") == "MoECommunicationError", stalled


def mismatched_experts(rank, world):
    layer = layer_for(dist.group.WORLD, experts=4 if rank == 0 else 8)
    train_steps(layer, 1)


@pytest.mark.slow
def test_workers_with_different_expert_counts_fail_at_the_first_forward_naming_them():
    results = run_workers_through_faults(mismatched_experts, 2, deadline=90)
    for rank, result in enumerate(results):
        assert result is not None and result.get("error") == "MoEOptionError", result  # a ValueError
        assert "MoE layer moe differs between this worker" in result["message"]
        assert "experts 4 vs 8" in result["message"] or "experts 8 vs 4" in result["message"]
        assert "build every worker's model with the same flags and world size" in result["message"]


def wrong_splits(rank, world):
    x = torch.randn(5, D)
    errors = []
    for send, recv in (([5], [5]), ([2, 2], [2, 2])):
        try:
            comm.all_to_all(x, send, recv, dist.group.WORLD)
        except ValueError as error:
            errors.append(str(error))
    return errors


@pytest.mark.slow
def test_all_to_all_refuses_splits_that_do_not_fit_the_group_or_the_input():
    for result in run_workers_through_faults(wrong_splits, 2, deadline=90):
        one_split, short_splits = result["returned"]
        assert "got 1 send and 1 receive splits for a group of 2 workers: pass one split per worker" in one_split
        assert "send splits sum to 4 rows but the input has 5" in short_splits


# Ops whose CUDA kernels add into shared rows with atomics, so that the order of additions (and the
# rounding) changes from run to run when indices repeat.
# fmt: off
ATOMIC_ACCUMULATION = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
                       "scatter_reduce_", "embedding_dense_backward", "put_", "_index_put_impl_", "index_put_",
                       "index_put"}
# fmt: on


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.accumulating = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        accumulate = kwargs.get("accumulate", len(args) > 3 and args[3] is True)
        if name in ATOMIC_ACCUMULATION and (not name.startswith(("index_put", "_index_put", "put")) or accumulate):
            self.accumulating.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(capacity_factor=0.5),
        dict(capacity_factor=1.0, batch_prioritized=True),
        dict(capacity_factor=-1.0),
        dict(padding=True),
        dict(padding=True, capacity_factor=0.5),
        dict(router_type="cosine"),
    ],
    ids=str,
)
@pytest.mark.parametrize("expert_matmul", ["loop", "grouped_mm"])
def test_no_path_of_the_layer_accumulates_with_atomics_so_gpu_runs_repeat_bit_for_bit(
    options, expert_matmul, monkeypatch
):
    if expert_matmul == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    monkeypatch.setenv(grouped_mm.ENV_VAR, expert_matmul)
    options = dict(options)
    padding = options.pop("padding", False)
    layer = layer_for(None, **options)
    x = torch.randn(3, 8, D, requires_grad=True)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 5:] = True
    with RecordOps() as recorder:
        y, aux = layer.forward_with_aux(x, mask if padding else None)
        (y.square().sum() + aux.balance_loss + aux.z_loss).backward()
    assert recorder.accumulating == [], recorder.accumulating
    assert x.grad is not None and all(p.grad is not None for p in layer.experts.parameters())
    assert layer.experts.matmul == expert_matmul


def test_the_recorder_sees_autograds_scatter_add(tmp_path):
    # The check above is only as good as its recorder: autograd's index_select backward must show up.
    x = torch.randn(4, D, requires_grad=True)
    with RecordOps() as recorder:
        x.index_select(0, torch.tensor([0, 0, 2])).sum().backward()
    assert any("index_add" in op for op in recorder.accumulating), recorder.accumulating
