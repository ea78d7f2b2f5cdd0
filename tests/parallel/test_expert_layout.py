"""The expert-parallel layout: which worker holds which experts, which workers form which group,
the default expert-parallel size, and the replica gradient sum. Arithmetic and recorded collectives
only: no worker processes (tests/parallel/test_fairseq_expert_parallel.py runs the layout on four)."""

import argparse
import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fairseq_moe_ext
from fairseq_moe_ext.moe.expert_layout import ExpertLayout, default_expert_parallel_size
from fairseq_moe_ext.parallel import expert_grads, plan
from fairseq_moe_ext.parallel.plan import ParallelPlan, plan_of, resolve_parallel_size


def test_four_workers_and_two_experts_form_two_expert_groups_and_two_replica_groups():
    layouts = [ExpertLayout(world_size=4, parallel_size=2, rank=r) for r in range(4)]
    assert [(l.ep_rank, l.replica_index, l.num_replicas) for l in layouts] == [
        (0, 0, 2),
        (1, 0, 2),
        (0, 1, 2),
        (1, 1, 2),
    ]
    assert [l.parallel_group_ranks for l in layouts] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [l.replica_group_ranks for l in layouts] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [list(l.experts_held(2)) for l in layouts] == [[0], [1], [0], [1]]
    assert [list(l.experts_held(8)) for l in layouts] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("world, parallel", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2), (12, 3)])
def test_groups_partition_the_world_and_a_workers_two_groups_meet_only_in_it(world, parallel):
    for rank in range(world):
        layout = ExpertLayout(world, parallel, rank)
        for groups in (layout.all_parallel_groups(), layout.all_replica_groups()):
            assert sorted(r for g in groups for r in g) == list(range(world))
        assert layout.parallel_group_ranks in layout.all_parallel_groups()
        assert layout.replica_group_ranks in layout.all_replica_groups()
        assert set(layout.parallel_group_ranks) & set(layout.replica_group_ranks) == {rank}
        assert len(layout.parallel_group_ranks) == parallel and len(layout.replica_group_ranks) == world // parallel
        # Consecutive ranks share the experts out; ranks P apart hold the same ones.
        assert layout.parallel_group_ranks == tuple(range(rank - rank % parallel, rank - rank % parallel + parallel))


@pytest.mark.parametrize("world, parallel, rank", [(4, 3, 0), (4, 0, 0), (4, 2, 4), (4, 2, -1), (0, 1, 0)])
def test_a_layout_with_a_size_not_dividing_the_world_or_a_rank_outside_it_is_refused(world, parallel, rank):
    with pytest.raises(ValueError, match="the expert-parallel size must divide the world size"):
        ExpertLayout(world, parallel, rank)


def test_experts_not_divisible_by_the_expert_parallel_size_cannot_be_placed():
    with pytest.raises(ValueError, match="3 experts cannot be split over an expert-parallel size of 2"):
        ExpertLayout(4, 2, 0).experts_held(3)


@pytest.mark.parametrize(
    "world, experts, parallel",
    [(2, 4, 2), (4, 8, 4), (8, 8, 8), (4, 2, 2), (4, 3, 1), (8, 12, 4), (6, 4, 2)],
)
def test_the_default_expert_parallel_size_is_the_largest_dividing_workers_and_experts(world, experts, parallel):
    # Experts a multiple of the workers (every run before P existed): P = W, today's layout exactly.
    assert default_expert_parallel_size(world, experts) == parallel
    assert resolve_parallel_size(argparse.Namespace(moe_expert_count=experts), world) == parallel


@pytest.mark.parametrize(
    "parallel, world, experts, message",
    [
        (
            3,
            4,
            2,
            "--moe-expert-parallel-size 3 does not divide the 4 workers: use a P dividing both 4 and "
            "--moe-expert-count 2 (1 or 2)",
        ),
        (
            4,
            4,
            2,
            "--moe-expert-parallel-size 4 does not divide --moe-expert-count 2: use a P dividing both 4 and "
            "--moe-expert-count 2 (1 or 2)",
        ),
        (
            3,
            8,
            12,
            "--moe-expert-parallel-size 3 does not divide the 8 workers: use a P dividing both 8 and "
            "--moe-expert-count 12 (1, 2 or 4)",
        ),
        (
            2,
            2,
            3,
            "--moe-expert-parallel-size 2 does not divide --moe-expert-count 3: use a P dividing both 2 and "
            "--moe-expert-count 3 (1)",
        ),
    ],
)
def test_an_expert_parallel_size_not_dividing_both_is_refused_listing_those_that_do(parallel, world, experts, message):
    args = argparse.Namespace(moe_expert_count=experts, moe_expert_parallel_size=parallel)
    with pytest.raises(ValueError) as refused:
        resolve_parallel_size(args, world)
    assert str(refused.value) == message


@pytest.fixture
def four_workers(monkeypatch):
    """torch.distributed as rank 3 of a 4-worker job sees it (no process group is created)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)


@pytest.mark.parametrize("experts, flag, parallel", [(2, None, 2), (8, None, 4), (3, None, 1), (8, 2, 2), (4, 1, 1)])
def test_building_a_model_on_four_workers_sets_the_layout_from_the_flag_or_its_default(
    four_workers, experts, flag, parallel
):
    args = argparse.Namespace(moe_expert_count=experts, moe_expert_parallel_size=flag)
    assert ParallelPlan.for_model(args, ("encoder", "decoder")).layout == ExpertLayout(4, parallel, 3)
    every_expert_local = ParallelPlan.for_model(args, ("encoder", "decoder"), every_expert_local=True)
    assert every_expert_local.layout == ExpertLayout(1, 1, 0)


def test_a_model_reads_the_layout_it_was_built_with_not_the_one_a_later_build_made(four_workers):
    model = torch.nn.Module()
    # What MoEModelMixin.build_moe_model keeps on the model.
    model.parallel_plan = ParallelPlan.for_model(
        argparse.Namespace(moe_expert_count=8, moe_expert_parallel_size=2), ("decoder",)
    )
    later = ParallelPlan.for_model(argparse.Namespace(moe_expert_count=8, moe_expert_parallel_size=4), ("decoder",))
    assert later.layout == ExpertLayout(4, 4, 3)
    assert plan_of(model).layout == ExpertLayout(4, 2, 3)


def test_a_model_without_moe_layers_is_one_shard_per_worker_as_before_the_flag_existed(four_workers):
    assert plan_of(torch.nn.Linear(1, 1)).layout == ExpertLayout(4, 4, 3)


def test_one_process_has_one_layout_and_no_groups_whatever_the_flag_says():
    assert not dist.is_initialized()
    one = ParallelPlan.for_model(
        argparse.Namespace(moe_expert_count=8, moe_expert_parallel_size=3), ("decoder",)
    )  # not refused
    assert one.layout == ExpertLayout(1, 1, 0)
    assert one.parallel_group is None
    assert one.replica_group is None
    assert one.statistics_group is None


@pytest.mark.parametrize("world, parallel", [(4, 2), (8, 2), (8, 4), (4, 1), (4, 4)])
def test_every_rank_creates_every_group_in_the_same_order_and_keeps_its_own(monkeypatch, world, parallel):
    created = {}  # rank -> memberships passed to new_group, in order
    for rank in range(world):
        calls = created.setdefault(rank, [])
        monkeypatch.setattr(
            dist, "new_group", lambda ranks, timeout=None, calls=calls: calls.append(tuple(ranks)) or tuple(ranks)
        )
        layout = ExpertLayout(world, parallel, rank)
        groups = plan._new_expert_groups(layout, None)
        assert groups.statistics == tuple(range(world))
        assert groups.parallel == (layout.parallel_group_ranks if parallel > 1 else None)
        assert groups.replica == (layout.replica_group_ranks if parallel < world else None)
    assert all(calls == created[0] for calls in created.values()), created
    assert len(set(created[0])) == len(created[0]), "a membership was made twice"


class RecordedReplicaSum:
    """``dist.all_reduce`` over a replica group of two identical replicas: doubles the tensor."""

    def __init__(self, monkeypatch):
        self.sizes = []
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo")
        monkeypatch.setattr(dist, "all_reduce", self)

    def __call__(self, tensor, group=None):
        self.sizes.append(tensor.numel())
        tensor.mul_(2)


def expert_and_shared_params():
    experts = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(5))]
    shared = torch.nn.Parameter(torch.randn(2))
    for p in experts:
        p.expert = True
    for p in experts[:3] + [shared]:
        p.grad = torch.randn_like(p)
    return experts, shared  # the last expert has no gradient (an expert no token reached)


@pytest.mark.parametrize("bucket, calls", [(1 << 26, [41]), (20, [12, 12, 17])])
def test_expert_gradients_are_summed_over_replicas_in_flat_buckets_shared_ones_not(monkeypatch, bucket, calls):
    reduce = RecordedReplicaSum(monkeypatch)
    monkeypatch.setattr(expert_grads, "EXPERT_GRAD_BUCKET_NUMEL", bucket)
    experts, shared = expert_and_shared_params()
    before = [p.grad.clone() for p in experts[:3]] + [torch.zeros(5)]
    shared_before = shared.grad.clone()
    expert_grads.sum_expert_grads_over_replicas(experts + [shared], group=object())
    assert reduce.sizes == calls  # never one all-reduce per parameter
    for p, want in zip(experts, before):
        assert torch.equal(p.grad, 2 * want)
    assert torch.equal(shared.grad, shared_before)


def test_the_default_expert_parallel_size_is_computed_by_one_function_only():
    """gcd(W, E) is the default P: every module that needs it calls default_expert_parallel_size."""
    root = Path(fairseq_moe_ext.PACKAGE_DIR)
    calls = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "gcd"
    )
    assert calls == ["moe/expert_layout.py"]
