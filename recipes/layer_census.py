"""The MoE layer's census by mode: the collectives and host syncs of one layer call on each worker.

Shared by the census test (tests/core/test_collective_census.py, workers as threads) and the layer
benchmark (benchmarks/moe_layer.py --census, gloo worker processes); counted by
``fairseq_moe_ext.moe.census.Census`` after a warm-up call (the layer's one-off set-up check is not
part of a steady-state call). A training call is counted as fairseq's MoE criterions run it: its forward
inside the cache's ``summing_collector``, so the layer's backward leaves the sum over workers of its losses'
gradients to the criterion, which takes it once per forward for every layer (the row ``criterion, per
forward``).
"""

from dataclasses import dataclass
from typing import Dict

import torch

from fairseq_moe_ext.moe import MoEAuxCache, MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.balance_bias import update_balance_biases
from fairseq_moe_ext.moe.census import Census
from fairseq_moe_ext.moe.comm import weight_summed_over_ranks
from fairseq_moe_ext.moe.lockstep import LockStep

D, H, E = 8, 16, 4
# name: (layer config, training, lock-step)
# fmt: off
MODES = {
    "training, dropless": (dict(k=2), True, False),
    "training, capacity": (dict(k=2, capacity_factor=0.5), True, False),
    "training, batch-prioritised": (dict(k=2, capacity_factor=0.5, batch_prioritized=True), True, False),
    "inference forward": (dict(k=2), False, False),
    "generation, lock-step": (dict(k=2), False, True),
}
# fmt: on


@dataclass
class Counted:
    forward: int  # collectives of one forward
    backward: int  # collectives of its backward
    forward_syncs: int  # host syncs of the forward
    backward_syncs: int
    sites: str  # where each was issued, for a failure message


def tokens(rank: int, seed: int = 0):
    """Uneven batches (2 + 3 * rank sentences of 5 tokens), the first sentence partly padding."""
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(2 + 3 * rank, 5, D, generator=g, requires_grad=True)
    mask = torch.zeros(2 + 3 * rank, 5, dtype=torch.bool)
    mask[0, 3:] = True
    return x, mask


def census_of_mode(mode: str, group, rank: int) -> Counted:
    """One call of ``mode``'s layer on this worker (every worker of ``group`` must run the same mode)."""
    config, training, lockstep = MODES[mode]
    torch.manual_seed(0)  # on threads (the census test) the workers share torch's generator: the counts never
    cache = MoEAuxCache()  # depend on the values it draws
    layer = MoELayer(MoELayerConfig.of(D, H, E, **config), cache=cache, seed=5, group=group).train(training)
    stepper = LockStep([[layer]], group) if lockstep else None
    found = None
    for _ in range(2):  # the first call is a warm-up (the layer's set-up check runs once)
        x, mask = tokens(rank)
        with cache.summing_collector(), Census() as forward:
            with torch.set_grad_enabled(training):
                if stepper is not None:
                    with stepper.session():
                        stepper.before(0)
                        y = layer(x, mask)
                        done = forward.collective_count, forward.count
                else:
                    y = layer(x, mask)
        if stepper is not None:  # the session's end (a round to leave it together) is not the call's
            forward.collectives, forward.sites = forward.collectives[: done[0]], forward.sites[: done[1]]
        (record,) = cache.collect()
        with Census() as backward:
            if training:
                aux = record.aux
                ((y * y).sum() + aux.balance_loss + aux.z_loss).backward()
        sites = f"forward:\n{forward.collective_summary()}\n{forward.summary()}\nbackward:\n"
        sites += f"{backward.collective_summary()}\n{backward.summary()}"
        found = Counted(forward.collective_count, backward.collective_count, forward.count, backward.count, sites)
    return found


def census_of_collector(group) -> Counted:
    """What the MoE criterion adds per forward (every layer's losses at once): the workers' weights of the
    losses summed in its backward (moe_criterions.add_moe_losses)."""
    losses = torch.ones((), requires_grad=True)
    with Census() as forward:
        aux = weight_summed_over_ranks(losses * 0.5, 3, group)
    with Census() as backward:
        aux.backward()
    sites = f"backward:\n{backward.collective_summary()}\n{backward.summary()}"
    return Counted(forward.collective_count, backward.collective_count, forward.count, backward.count, sites)


def census_of_bias_update(group, rank: int) -> Counted:
    """``--moe-balance bias``: the bias moved after an optimizer step (per layer; counted as a forward)."""
    torch.manual_seed(0)
    layer = MoELayer(MoELayerConfig.of(D, H, E, k=2, balance_bias_rate=1e-3), seed=5, group=group)
    layer(tokens(rank)[0].detach())
    with Census() as update:
        update_balance_biases(layer)
    sites = f"update:\n{update.collective_summary()}\n{update.summary()}"
    return Counted(update.collective_count, 0, update.count, 0, sites)


def census_of_modes(group, rank: int) -> Dict[str, Counted]:
    counts = {mode: census_of_mode(mode, group, rank) for mode in MODES}
    counts["criterion, per forward"] = census_of_collector(group)
    counts["balance-bias update, per step"] = census_of_bias_update(group, rank)
    return counts


def census_table(counts: Dict[str, Counted]) -> str:
    lines = [f"{'mode':<30}{'collectives fwd':>16}{'bwd':>5}{'host syncs fwd':>16}{'bwd':>5}"]
    for mode, c in counts.items():
        lines.append(f"{mode:<30}{c.forward:>16}{c.backward:>5}{c.forward_syncs:>16}{c.backward_syncs:>5}")
    return "\n".join(lines)
