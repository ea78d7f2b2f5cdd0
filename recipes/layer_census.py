"""The MoE layer's census by mode: the collectives and host syncs of one layer call on each worker.

Shared by the census test (tests/core/test_collective_census.py, workers as threads) and the layer
benchmark (benchmarks/moe_layer.py --census, gloo worker processes); counted by
``fairseq_moe_ext.moe.census.Census`` after a warm-up call (the layer's one-off set-up check is not
part of a steady-state call). A training call is counted as fairseq's MoE criterions run it: its forward
inside the cache's ``summing_collector``, so the layer's backward leaves the sum over workers of its losses'
gradients to the criterion, which takes it once per forward for every layer (the row ``criterion, per
forward``).
"""

import time
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


# What each worker issues per mode: (collectives in forward, in backward, host syncs in forward, in backward);
# the census test holds the harness to it on CPU threads, the GPU one-shot on CUDA, docs/performance.md prints it.
# fmt: off
EXPECTED = {
    "training, dropless": (3, 2, 1, 0),
    "training, capacity": (3, 2, 1, 0),
    "training, batch-prioritised": (4, 2, 2, 0),
    "inference forward": (3, 0, 1, 0),
    "generation, lock-step": (3, 0, 1, 0),
    "criterion, per forward": (0, 1, 0, 0),
    "balance-bias update, per step": (0, 0, 0, 0),
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
    x = torch.randn(2 + 3 * rank, 5, D, generator=g)
    mask = torch.zeros(2 + 3 * rank, 5, dtype=torch.bool)
    mask[0, 3:] = True
    return x, mask


def census_of_mode(mode: str, group, rank: int, device=None) -> Counted:
    """One call of ``mode``'s layer on this worker (every worker of ``group`` must run the same mode)."""
    config, training, lockstep = MODES[mode]
    torch.manual_seed(0)  # on threads (the census test) the workers share torch's generator: the counts never
    cache = MoEAuxCache()  # depend on the values it draws
    layer = MoELayer(MoELayerConfig.of(D, H, E, **config), cache=cache, seed=5, group=group).train(training)
    layer.to(device)
    stepper = LockStep([[layer]], group) if lockstep else None
    found = None
    for _ in range(2):  # the first call is a warm-up (the layer's set-up check runs once)
        x, mask = (t.to(device) for t in tokens(rank))
        x.requires_grad_(training)
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


def census_of_collector(group, device=None) -> Counted:
    """What the MoE criterion adds per forward (every layer's losses at once): the workers' weights of the
    losses summed in its backward (moe_criterions.add_moe_losses)."""
    losses = torch.ones((), device=device, requires_grad=True)
    with Census() as forward:
        aux = weight_summed_over_ranks(losses * 0.5, 3, group)
    with Census() as backward:
        aux.backward()
    sites = f"backward:\n{backward.collective_summary()}\n{backward.summary()}"
    return Counted(forward.collective_count, backward.collective_count, forward.count, backward.count, sites)


def census_of_bias_update(group, rank: int, device=None) -> Counted:
    """``--moe-balance bias``: the bias moved after an optimizer step (per layer; counted as a forward)."""
    torch.manual_seed(0)
    layer = MoELayer(MoELayerConfig.of(D, H, E, k=2, balance_bias_rate=1e-3), seed=5, group=group).to(device)
    layer(tokens(rank)[0].to(device))
    with Census() as update:
        update_balance_biases(layer)
    sites = f"update:\n{update.collective_summary()}\n{update.summary()}"
    return Counted(update.collective_count, 0, update.count, 0, sites)


def census_of_modes(group, rank: int, device=None) -> Dict[str, Counted]:
    counts = {mode: census_of_mode(mode, group, rank, device) for mode in MODES}
    counts["criterion, per forward"] = census_of_collector(group, device)
    counts["balance-bias update, per step"] = census_of_bias_update(group, rank, device)
    return counts


def timed_call(group, rank: int, device=None, d=512, h=1024, experts=8, rows=2048, dtype=torch.float32, reps=3):
    """Seconds in each collective of one training call (forward and backward, dropless, ``rows`` tokens per
    worker) against the call's own, the device synchronised around each collective (``Census(timed=True)``);
    the median call of ``reps`` after a warm-up. Returns ``(call seconds, [(op, seconds, bytes), ...])``."""
    torch.manual_seed(0)
    cache = MoEAuxCache()
    layer = MoELayer(MoELayerConfig.of(d, h, experts, k=2), cache=cache, seed=5, group=group).to(device, dtype)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(rank)).to(device, dtype).requires_grad_()
    calls = []
    for _ in range(reps + 1):
        _synchronise(device)
        with cache.summing_collector(), Census(timed=True) as census:
            started = time.perf_counter()
            y = layer(x)
            (aux,) = (r.aux for r in cache.collect())
            losses = weight_summed_over_ranks(aux.balance_loss + aux.z_loss, 1.0, aux.collector_sums_over)
            ((y.float() ** 2).mean() + losses).backward()
            _synchronise(device)
            seconds = time.perf_counter() - started
        calls.append((seconds, [(c.op, c.seconds, c.nbytes) for c in census.collectives]))
    return sorted(calls[1:], key=lambda call: call[0])[len(calls[1:]) // 2]


def _synchronise(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_lines(call) -> str:
    seconds, collectives = call
    lines = [f"{op:<20}{spent * 1e3:>10.2f} ms{nbytes / 2**20:>10.2f} MiB" for op, spent, nbytes in collectives]
    spent = sum(c[1] for c in collectives)
    lines.append(
        f"{len(collectives)} collectives: {spent * 1e3:.1f} ms of a {seconds * 1e3:.1f} ms call ({spent / seconds:.0%})"
    )
    return "\n".join(lines)


def census_table(counts: Dict[str, Counted]) -> str:
    lines = [f"{'mode':<30}{'collectives fwd':>16}{'bwd':>5}{'host syncs fwd':>16}{'bwd':>5}"]
    for mode, c in counts.items():
        lines.append(f"{mode:<30}{c.forward:>16}{c.backward:>5}{c.forward_syncs:>16}{c.backward_syncs:>5}")
    return "\n".join(lines)
