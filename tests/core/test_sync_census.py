"""The MoE hot path makes a GPU wait for the host once per layer forward, and never in backward.

Counted on CPU by ``fairseq_moe_ext.moe.census.Census`` (every op that would be a host sync on CUDA). Bounds
per layer forward: 1 (dropless: the rows per expert, which the expert GEMMs and the all-to-all
need as sizes, read in one ``tolist``), 2 with batch-prioritised capacity on several workers (the
gathered routing decisions' sizes as well); 0 per backward; at most 1 for the global grad norm and for the
criterion per step. Statistics for the logs stay on the device until the criterion reads them.
"""

import pytest
import torch
import torch.distributed as dist

from fairseq_moe_ext.criterions.moe_criterions import MoELossMixin
from fairseq_moe_ext.moe import MoEAuxCache, MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.census import Census
from fairseq_moe_ext.parallel.grad_norm import global_grad_norm
from support.launch.dist_utils import run_on_workers

D, H, E = 8, 16, 4
# fmt: off
PATHS = {  # name: (layer arguments, padded)
    "dropless": (dict(k=2), False),
    "dropless-padded": (dict(k=2), True),
    "capacity": (dict(k=2, capacity_factor=0.5), False),
    "capacity-padded-prioritized": (dict(k=1, capacity_factor=0.5, batch_prioritized=True), True),
    "bounded-dropless": (dict(k=2, capacity_factor=-0.75), True),
}
# fmt: on
# fmt: off
ROUTERS = {
    "top": dict(router_type="top"),
    "top-noisy": dict(router_type="top", gate_noise=1.0),
    "cosine": dict(router_type="cosine", normalize_gates=True),
}
# fmt: on


def census_of_one_step(layer, x, mask):
    """Host syncs of one forward and of its backward (after a first, warm-up step)."""
    counts = []
    for _ in range(2):
        with Census() as forward:
            y, aux = layer.forward_with_aux(x, mask)
        loss = (y * y).sum() + aux.balance_loss + aux.z_loss
        with Census() as backward:
            loss.backward()
        counts.append((forward, backward))
    return counts[-1]


def tokens(rows, padded, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 5, D, generator=g, requires_grad=True)
    mask = None
    if padded:
        mask = torch.zeros(rows, 5, dtype=torch.bool)
        mask[0, 2:] = True
    return x, mask


CASES = [(path, router, "loop") for path in PATHS for router in ROUTERS] + [
    (path, "top", "grouped_mm") for path in PATHS
]


@pytest.mark.parametrize("path, router, matmul", CASES)
def test_one_process_layer_syncs_once_per_forward_and_never_in_backward(path, router, matmul):
    kwargs, padded = PATHS[path]
    torch.manual_seed(0)
    layer = MoELayer(MoELayerConfig.of(D, H, E, **kwargs, **ROUTERS[router]))
    layer.experts.matmul = matmul
    forward, backward = census_of_one_step(layer, *tokens(4, padded))
    assert forward.count <= 1, forward.summary()
    assert backward.count == 0, backward.summary()


@pytest.mark.parametrize("matmul", ["loop", "grouped_mm"])
def test_shared_experts_add_no_host_sync_to_the_layer_forward_on_either_expert_path(matmul):
    # The shared experts run as one expert of all the tokens: their one row count is the input's
    # shape, known on the host, and must not cross to the device as a copy (a second sync).
    torch.manual_seed(0)
    layer = MoELayer(MoELayerConfig.of(D, H, E, k=2, shared_expert_count=2))
    layer.experts.matmul = layer.shared_experts.ffn.matmul = matmul
    forward, backward = census_of_one_step(layer, *tokens(4, padded=True))
    assert forward.count <= 1, forward.summary()
    assert backward.count == 0, backward.summary()


def test_the_census_sees_every_kind_of_host_sync():
    t = torch.arange(6)
    with Census() as census:
        t.sum().item(), int(t[1]), bool(t[2] > 0), t.tolist(), t.cpu(), t.numpy()
        t.nonzero(), t[t > 2], torch.bincount(t), torch.unique(t), t.masked_select(t > 1)
        torch.repeat_interleave(t), torch.tensor([1, 2]), t.new_tensor([3])
        torch.repeat_interleave(t, t, output_size=15), t.sum(), t.argsort()  # these three are not syncs
    kinds = [site.split(" at ")[0] for site in census.sites]
    assert (
        kinds
        == ["item"] * 3
        + [
            "tolist",
            "cpu",
            "numpy",
            "nonzero",
            "boolean indexing",
            "bincount",
            "unique",
            "masked_select",
            "repeat_interleave without output_size",
        ]
        + ["host-to-device copy"] * 2
    )


def test_the_grad_norm_and_the_criterion_read_the_host_at_most_once_per_step():
    torch.manual_seed(0)
    cache = MoEAuxCache()
    layers = [MoELayer(MoELayerConfig(D, H, E), cache=cache, name=f"decoder.layers.{i}.fc1") for i in range(3)]
    x, mask = tokens(4, padded=True)
    for layer in layers:
        x = x + layer(x, mask)
    model = torch.nn.Module()
    model.moe_cache = cache
    criterion = MoELossMixin()
    criterion._init_moe_loss(0.01, 0.1, "average", False)
    log = {}
    with Census() as at_criterion:
        loss = criterion.add_moe_losses(model, x.pow(2).sum(), 20, log)
    loss.backward()
    with Census() as at_grad_norm:
        norm = global_grad_norm([p for layer in layers for p in layer.parameters()])
    assert at_criterion.count <= 1, at_criterion.summary()
    assert at_grad_norm.count <= 1, at_grad_norm.summary()
    assert norm > 0 and log["moe_stat_dec0_num_tokens"] == 17 and log["moe_stat_dec2_e0"] >= 0


TWO_WORKER_BOUNDS = {"dropless": 1, "dropless-padded": 1, "capacity": 1, "capacity-padded-prioritized": 2}


def expert_parallel_census(rank, world):
    found = {}
    for path in TWO_WORKER_BOUNDS:  # one spawn for all paths: starting workers is the slow part
        kwargs, padded = PATHS[path]
        torch.manual_seed(0)
        layer = MoELayer(MoELayerConfig.of(D, H, E, **kwargs), seed=5, group=dist.group.WORLD)
        forward, backward = census_of_one_step(layer, *tokens(2 + 3 * rank, padded, seed=rank))
        found[path] = (forward.count, forward.summary(), backward.count, backward.summary())
    return found


@pytest.mark.slow
def test_two_workers_sync_once_per_forward_twice_if_batch_prioritised_never_in_backward():
    for found in run_on_workers(expert_parallel_census, 2):
        for path, bound in TWO_WORKER_BOUNDS.items():
            forward, forward_sites, backward, backward_sites = found[path]
            assert forward <= bound, f"{path}: {forward_sites}"
            assert backward == 0, f"{path}: {backward_sites}"
