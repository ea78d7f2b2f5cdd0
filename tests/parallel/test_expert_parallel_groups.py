"""Which group each expert-parallel reduction runs over, and the numbers it gives: four workers as
threads of this process (tests/support/launch/thread_world.py), two expert shards (P = 2), so every worker has an
expert-parallel group {0, 1} or {2, 3}, a replica group {0, 2} or {1, 3} and the world, and a
reduction over the wrong one changes the result. In seconds, without worker processes; the slow
oracle (tests/parallel/test_fairseq_expert_parallel.py) runs the same layouts through fairseq's Trainer."""

import argparse

import pytest
import torch
from fairseq.models.distributed_fairseq_model import DistributedFairseqModel

from fairseq_moe_ext.fairseq_integration import training
from fairseq_moe_ext.moe import MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.balance_bias import update_balance_biases
from fairseq_moe_ext.moe.expert_layout import ExpertLayout
from fairseq_moe_ext.parallel import expert_grads, grad_norm, plan
from fairseq_moe_ext.parallel.plan import ParallelPlan, plan_of
from support.launch.in_process_trainer import collate, sentence_pairs, training_args, write_dictionaries
from support.launch.thread_world import ThreadWorld

W, P = 4, 2
WORLD = tuple(range(W))
LAYOUTS = [ExpertLayout(W, P, rank) for rank in range(W)]


@pytest.fixture
def world(monkeypatch):
    return ThreadWorld(W).install(monkeypatch)


# --- The layer: routing statistics over the world, tokens within the expert-parallel group. --------

D, H, E = 8, 16, 4
SIZES = [5, 9, 0, 7]  # tokens per worker; rank 2 has none (fairseq's dummy batch)


def layer(group=None, statistics_group=None):
    torch.manual_seed(0)  # the shared weights (router) come from the common seed, experts from their ids
    return MoELayer(
        MoELayerConfig.of(D, H, E, k=2, capacity_factor=0.75, balance_bias_rate=0.05),
        seed=5,
        group=group,
        statistics_group=statistics_group,
    )


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(SIZES), D, generator=g), torch.randn(sum(SIZES), D, generator=g)


def step(moe, x, upstream, aux_weight):
    y, aux = moe.forward_with_aux(x)
    ((y * upstream).sum() + aux_weight * (aux.balance_loss + 0.1 * aux.z_loss)).backward()
    return y.detach(), aux


def layer_step_on_worker(rank, layers):
    """One worker's forward and backward on its share of the batch, then what training does next:
    shared gradients summed over the world (data parallelism), expert gradients over the replicas,
    the balance bias moved."""
    groups = plan._new_expert_groups(LAYOUTS[rank], None)
    moe = layers[rank]
    x, upstream = batch()
    rows = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    # Each worker weighs the shared losses by its share of the tokens, as fairseq does by sample size.
    y, aux = step(moe, x[rows], upstream[rows], SIZES[rank] / sum(SIZES))
    torch.distributed.all_reduce(moe.router.wg.weight.grad, group=groups.statistics)
    expert_grads.sum_expert_grads_over_replicas(moe.experts.parameters(), groups.replica)
    update_balance_biases(moe)
    return {
        "y": y,
        "balance": aux.balance_loss.item(),
        "z": aux.z_loss.item(),
        "dropped": aux.stats["dropped_slots"].item(),
        "router_grad": moe.router.wg.weight.grad,
        "expert_grads": {n: p.grad for n, p in moe.experts.named_parameters()},
        "bias": moe.router.balance_bias.bias,
    }


def test_four_workers_on_two_expert_shards_give_the_losses_grads_and_bias_of_one_process(world):
    layers = []
    for rank in range(W):  # built as each worker builds its own, with the groups it makes
        with world.as_rank(rank):
            groups = plan._new_expert_groups(LAYOUTS[rank], None)
            layers.append(layer(groups.parallel, groups.statistics))
            assert groups.parallel.ranks == LAYOUTS[rank].parallel_group_ranks and groups.statistics.ranks == WORLD
    results = world.run(layer_step_on_worker, layers)

    reference = layer()
    x, upstream = batch()
    y_ref, aux_ref = step(reference, x, upstream, 1.0)
    update_balance_biases(reference)
    assert aux_ref.stats["dropped_slots"].item() > 0, "the case should exercise the capacity decision"
    assert reference.router.balance_bias.bias.abs().max() > 0, "the case should move the bias"

    torch.testing.assert_close(torch.cat([r["y"] for r in results]), y_ref, rtol=1e-5, atol=1e-5)
    assert sum(r["dropped"] for r in results) == aux_ref.stats["dropped_slots"].item()
    for r in results:
        assert r["balance"] == pytest.approx(aux_ref.balance_loss.item(), rel=1e-5)
        assert r["z"] == pytest.approx(aux_ref.z_loss.item(), rel=1e-5)
        torch.testing.assert_close(r["router_grad"], reference.router.wg.weight.grad, rtol=1e-4, atol=1e-6)
        assert torch.equal(r["bias"], reference.router.balance_bias.bias)
    local = E // P
    for name, p in reference.experts.named_parameters():
        for rank, r in enumerate(results):  # after the replica sum: the whole world's tokens
            held = slice(LAYOUTS[rank].ep_rank * local, (LAYOUTS[rank].ep_rank + 1) * local)
            torch.testing.assert_close(
                r["expert_grads"][name], p.grad[held], rtol=1e-4, atol=1e-6, msg=f"{name} on rank {rank}"
            )


# --- Hook 3: expert gradients over their replicas, the gradient norm over the expert-parallel group. --


class SharedAndExpert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Parameter(torch.ones(3))
        self.expert = torch.nn.Parameter(torch.ones(2, 3))
        self.expert.expert = True


def wrapped_reduce_on_worker(rank, args):
    """Gradients 2**rank, wrapped for training by hook 3 (legacy_ddp), all-reduced as fairseq's
    Trainer does, then the norm that fairseq clips with (hook 4's)."""
    model = SharedAndExpert()
    model.parallel_plan = ParallelPlan(W, P, rank)  # what building a model with --moe-expert-parallel-size 2 keeps
    model.shared.grad = torch.full((3,), 2.0**rank)
    model.expert.grad = torch.full((2, 3), 2.0**rank)
    wrapped = training.wrap_distributed_model(DistributedFairseqModel)(
        args, model, torch.distributed.new_group(), torch.device("cpu")
    )
    wrapped.all_reduce_grads()
    norm = grad_norm.clip_grad_norm_(list(model.parameters()), 0, plan_of(model).parallel_group)  # as hook 4
    return model.shared.grad, model.expert.grad, norm


def test_hook_3_sums_expert_grads_over_replicas_and_the_norm_counts_each_expert_once(world):
    args = argparse.Namespace(ddp_backend="legacy_ddp", tpu=False, heartbeat_timeout=-1)
    results = world.run(wrapped_reduce_on_worker, args)
    mean = sum(2.0**r for r in WORLD) / W
    # Ranks {0, 2} hold expert shard 0, ranks {1, 3} shard 1; each sum is divided by W (fairseq's
    # world_size / sample_size rescaling then treats it as it treats averaged shared gradients).
    shard = [sum(2.0**r for r in LAYOUTS[e].replica_group_ranks) / W for e in range(P)]
    norm = (3 * mean**2 + sum(6 * s**2 for s in shard)) ** 0.5
    for rank, (shared, expert, got_norm) in enumerate(results):
        assert torch.equal(shared, torch.full((3,), mean)), f"rank {rank}'s shared gradient"
        assert torch.equal(expert, torch.full((2, 3), shard[LAYOUTS[rank].ep_rank])), f"rank {rank}'s expert gradient"
        assert got_norm.item() == pytest.approx(norm, rel=1e-6), f"rank {rank}'s gradient norm"


# --- The model: every collective of a training step, by the group it runs over. --------------------


def build_models(data_dir, world):
    """The task, its flags and, for each rank, the model and criterion that worker builds."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq import options, tasks

    flags = [
        "--moe-expert-count",
        "2",
        "--moe-balance",
        "bias",
        "--moe-capacity-factor",
        "1.0",
        "--ddp-backend",
        "legacy_ddp",
    ]
    args = options.parse_args_and_arch(options.get_training_parser(), training_args(data_dir, W, flags))
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    built = []
    for rank in range(W):
        with world.as_rank(rank):
            torch.manual_seed(cfg.common.seed)
            built.append((task, args, task.build_model(cfg.model), task.build_criterion(cfg.criterion)))
    return built


def training_step_on_worker(rank, built):
    task, args, model, criterion = built[rank]
    wrapped = training.wrap_distributed_model(DistributedFairseqModel)(
        args, model, torch.distributed.new_group(), torch.device("cpu")
    )
    loss, _, _ = criterion(wrapped, collate(task, sentence_pairs(12)[3 * rank : 3 * rank + 3]))
    loss.backward()
    wrapped.all_reduce_grads()
    grad_norm.clip_grad_norm_(list(model.parameters()), 0.7, plan_of(model).parallel_group)
    update_balance_biases(model)


def test_every_collective_of_a_four_worker_step_runs_over_the_group_the_docs_name(world, tmp_path):
    """docs/placement.md's "What is reduced where", per worker, from what a real model built for rank r of
    4 with 2 experts issues in a step (forward, backward, hook 3's all-reduce, the norm, the bias)."""
    write_dictionaries(str(tmp_path))
    built = build_models(str(tmp_path), world)
    world.run(training_step_on_worker, built)
    for rank, layout in enumerate(LAYOUTS):
        row, column = layout.parallel_group_ranks, layout.replica_group_ranks
        issued = world.issued(rank)
        checks = {name for name in issued if name.startswith("check of MoE layer ")}
        assert len(checks) == 2, issued  # one per MoE layer, before its first exchange
        assert {issued.pop(name) == {WORLD} for name in checks} == {True}, "layer checks run over the world"
        assert issued == {
            "check of shared parameters": {WORLD},
            # The losses' sums, the capacity decision, every worker's rows for each expert (the receive counts).
            "all-gather of routing counts and sums": {WORLD},
            "all-reduce of routing statistics": {WORLD},  # the criterion: the losses' weights, once per forward
            "all-to-all of token rows": {row},
            "all-reduce of expert gradients over their replicas": {column},
            "all-reduce of expert gradient norms": {row},
        }, f"rank {rank}"
