"""The losses' gradients summed over workers once per forward by their collector (the MoE criterions:
``cache.summing_collector`` and ``comm.weight_summed_over_ranks``) equal those each layer sums in its own
backward, and one process weighing the losses by the workers' weights summed: every worker's input and
expert gradients, and the router's gradient summed over workers as data parallelism sums it."""

import contextlib

import pytest
import torch

from fairseq_moe_ext.moe import MoEAuxCache, MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.comm import weight_summed_over_ranks
from support.launch.thread_world import ThreadWorld

D, H, E = 8, 16, 4


def stack(group, cache, capacity_factor):
    torch.manual_seed(0)  # the routers: shared weights, the same on every worker
    config = MoELayerConfig.of(D, H, E, k=2, capacity_factor=capacity_factor)
    return [MoELayer(config, group=group, cache=cache, name=f"moe{i}", seed=3 + i) for i in range(2)]


def batch(sizes):
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(sizes), D, generator=g), torch.randn(sum(sizes), D, generator=g)


def step(layers, cache, x, upstream, weight, group, summing):
    """Two MoE layers side by side (one's output never routes the other's tokens: a rounding difference cannot
    flip a choice), then the criterion's objective: ``upstream . y + weight * (0.01 * balance + 0.1 * z)``, this
    worker's ``weight`` (fairseq: its sample size)."""
    x = x.clone().requires_grad_()
    with cache.summing_collector() if summing else contextlib.nullcontext():
        y = x + sum(layer(x) for layer in layers)
    records = cache.collect()
    losses = sum(0.01 * r.aux.balance_loss + 0.1 * r.aux.z_loss for r in records)
    sum_over = records[0].aux.collector_sums_over
    assert sum_over is (group if summing else None)
    aux = weight_summed_over_ranks(losses, weight, sum_over) if summing else weight * losses
    ((y * upstream).sum() + aux).backward()
    return x.grad


def on_worker(rank, world, built, sizes, summing):
    group = world.world_group
    cache, layers = built[rank]
    x, upstream = batch(sizes)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    x_grad = step(layers, cache, x[rows], upstream[rows], float(sizes[rank] + 1), group, summing)
    routers = [layer.router.wg.weight.grad.clone() for layer in layers]
    for grad in routers:
        world.all_reduce(grad, group=group)  # what data parallelism does to shared gradients
    experts = [{n: p.grad.clone() for n, p in layer.experts.named_parameters()} for layer in layers]
    return x_grad, routers, experts


@pytest.mark.parametrize("sizes", [[13, 6], [7, 0, 12, 3]])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
def test_losses_summed_once_by_the_collector_give_the_gradients_of_one_process(monkeypatch, sizes, capacity_factor):
    world = ThreadWorld(len(sizes)).install(monkeypatch)
    by_mode = {}
    for summing in (True, False):
        built = []
        for rank in range(len(sizes)):  # in this thread: torch's global generator is not the workers' own
            with world.as_rank(rank):
                cache = MoEAuxCache()
                built.append((cache, stack(world.world_group, cache, capacity_factor)))
        by_mode[summing] = world.run(on_worker, world, built, sizes, summing)
    cache = MoEAuxCache()
    reference = stack(None, cache, capacity_factor)
    x, upstream = batch(sizes)
    weights = float(sum(n + 1 for n in sizes))
    x_grad = step(reference, cache, x, upstream, weights, None, summing=True)
    for summing, results in by_mode.items():
        what = "summed once by the collector" if summing else "summed by each layer"
        got = torch.cat([r[0] for r in results])
        torch.testing.assert_close(got, x_grad, rtol=1e-5, atol=1e-6, msg=f"{what}: {(got - x_grad).abs().max()}")
        for i, layer in enumerate(reference):
            for r in results:
                torch.testing.assert_close(r[1][i], layer.router.wg.weight.grad, rtol=1e-5, atol=1e-6, msg=what)
            for name, p in layer.experts.named_parameters():
                got = torch.cat([r[2][i][name] for r in results])
                torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")
    # Between the two modes only the order of the fp32 sums differs.
    for once, each in zip(by_mode[True], by_mode[False]):
        torch.testing.assert_close(once[0], each[0], rtol=1e-6, atol=1e-7)
