"""Expert parallelism in the core: W gloo workers equal one process holding every expert."""

import pytest
import torch
import torch.distributed as dist

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.reference import reference_bias_update, reference_moe
from support.launch.dist_utils import run_on_workers

D, H, E = 8, 16, 4
pytestmark = pytest.mark.slow


def build(group, k, cf, prioritized):
    torch.manual_seed(0)  # shared weights (the router) come from the common seed
    return MoELayer(
        MoELayerConfig.of(D, H, E, k=k, capacity_factor=cf, batch_prioritized=prioritized), seed=5, group=group
    )


def batch(sizes):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), D, generator=g)
    upstream = torch.randn(sum(sizes), D, generator=g)
    return x, upstream


def objective(layer, x, upstream, aux_weight):
    y, aux = layer.forward_with_aux(x)
    loss = (y * upstream).sum() + aux_weight * (aux.balance_loss + 0.1 * aux.z_loss)
    loss.backward()
    return y.detach(), aux


def expert_parallel_step(rank, world, sizes, k, cf, prioritized):
    layer = build(dist.group.WORLD, k, cf, prioritized)
    x, upstream = batch(sizes)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    # Each worker weighs the shared losses by its share of tokens: the weights sum to one, as in
    # fairseq where every worker scales them by its own sample size.
    y, aux = objective(layer, x[rows], upstream[rows], sizes[rank] / sum(sizes))
    router_grad = layer.router.wg.weight.grad.clone()
    dist.all_reduce(router_grad)  # what data-parallel training does to shared gradients
    return {
        "y": y,
        "balance": aux.balance_loss.item(),
        "z": aux.z_loss.item(),
        "dropped": aux.stats["dropped_slots"].item(),
        "router_grad": router_grad,
        "experts": {n: p.detach().clone() for n, p in layer.experts.named_parameters()},
        "expert_grads": {n: p.grad.clone() for n, p in layer.experts.named_parameters()},
    }


@pytest.mark.parametrize(
    "world, sizes, k, cf, prioritized",
    [
        (2, [13, 13], 2, 0.0, False),  # equal token counts, dropless
        (2, [5, 21], 2, 0.0, False),  # unequal token counts
        (2, [9, 17], 2, 0.5, False),  # with drops
        (2, [9, 17], 1, 0.5, True),  # with drops, batch-prioritised
        (4, [7, 0, 12, 3], 2, 0.75, False),  # a worker with no tokens (fairseq's dummy batch)
    ],
)
def test_expert_parallel_step_equals_single_process_with_all_experts(world, sizes, k, cf, prioritized):
    results = run_on_workers(expert_parallel_step, world, sizes, k, cf, prioritized)

    reference = build(None, k, cf, prioritized)
    x, upstream = batch(sizes)
    y_ref, aux_ref = objective(reference, x, upstream, 1.0)

    torch.testing.assert_close(torch.cat([r["y"] for r in results]), y_ref, rtol=1e-5, atol=1e-5)
    for r in results:
        assert r["balance"] == pytest.approx(aux_ref.balance_loss.item(), rel=1e-5)
        assert r["z"] == pytest.approx(aux_ref.z_loss.item(), rel=1e-5)
        torch.testing.assert_close(r["router_grad"], reference.router.wg.weight.grad, rtol=1e-4, atol=1e-6)
    assert sum(r["dropped"] for r in results) == aux_ref.stats["dropped_slots"].item()
    if cf:
        assert aux_ref.stats["dropped_slots"].item() > 0, "the case should exercise dropping"
    local = E // world
    for name, p in reference.experts.named_parameters():
        weights = torch.cat([r["experts"][name] for r in results])
        grads = torch.cat([r["expert_grads"][name] for r in results])
        torch.testing.assert_close(weights, p.detach(), rtol=0, atol=0, msg=f"{name} (global ids)")
        torch.testing.assert_close(grads, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        assert all(r["experts"][name].shape[0] == local for r in results)


def uneven_experts(rank, world):
    try:
        MoELayer(MoELayerConfig(D, H, 3), group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def test_an_expert_count_not_divisible_by_the_world_size_is_refused():
    messages = run_on_workers(uneven_experts, 2)
    assert all("3 experts cannot be split evenly over 2 workers" in m for m in messages)


def build_extended(group):
    torch.manual_seed(0)
    layer = MoELayer(
        MoELayerConfig.of(D, H, E, k=2, router_type="sigmoid", shared_expert_count=2, balance_bias_rate=0.05),
        seed=5,
        group=group,
    )
    layer.router.balance_bias.bias.copy_(torch.tensor([0.1, -0.05, 0.0, 0.05]))  # changes some choices
    return layer


def extended_step(rank, world, sizes):
    from fairseq_moe_ext.moe.balance_bias import update_balance_biases

    layer = build_extended(dist.group.WORLD)
    x, upstream = batch(sizes)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    y, _ = objective(layer, x[rows], upstream[rows], sizes[rank] / sum(sizes))
    update_balance_biases(layer)
    shared_grads = {n: p.grad.clone() for n, p in layer.shared_experts.named_parameters()}
    for g in shared_grads.values():
        dist.all_reduce(g)
    return {
        "y": y,
        "bias": layer.router.balance_bias.bias.clone(),
        "shared_grads": shared_grads,
        "expert_grads": {n: p.grad.clone() for n, p in layer.experts.named_parameters()},
    }


def test_shared_experts_sigmoid_and_balance_bias_on_two_workers_equal_one_process():
    sizes = [5, 21]
    results = run_on_workers(extended_step, 2, sizes)

    from fairseq_moe_ext.moe.balance_bias import update_balance_biases

    reference = build_extended(None)
    x, upstream = batch(sizes)
    choices = []
    reference_moe(reference, x, choices_out=choices)
    bias = reference.router.balance_bias.bias.clone()
    local = [reference_bias_update(bias, choices[:5], E, 0.05), reference_bias_update(bias, choices[5:], E, 0.05)]
    y_ref, _ = objective(reference, x, upstream, 1.0)
    update_balance_biases(reference)
    want = reference_bias_update(bias, choices, E, 0.05)
    torch.testing.assert_close(reference.router.balance_bias.bias, want.float(), rtol=0, atol=1e-7)
    assert not any(torch.allclose(want, w) for w in local), "each worker's own load would move the bias otherwise"

    torch.testing.assert_close(torch.cat([r["y"] for r in results]), y_ref, rtol=1e-5, atol=1e-5)
    for r in results:
        # The bias moved by the load of both workers' tokens: identical everywhere, as one process's.
        assert torch.equal(r["bias"], results[0]["bias"])
        torch.testing.assert_close(r["bias"], reference.router.balance_bias.bias, rtol=0, atol=1e-7)
        for name, p in reference.shared_experts.named_parameters():
            torch.testing.assert_close(r["shared_grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    for name, p in reference.experts.named_parameters():
        torch.testing.assert_close(
            torch.cat([r["expert_grads"][name] for r in results]), p.grad, rtol=1e-4, atol=1e-6, msg=name
        )
