"""Lock-step inference in the core: workers running different numbers of MoE calls, or none at all,
get exactly what one process holding every expert computes, and nobody waits forever."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.lockstep import LockStep
from support.launch.dist_utils import run_on_workers, run_workers_through_faults

D, H, E = 8, 16, 6
pytestmark = pytest.mark.slow


def build_stacks(group):
    """Two stacks ("encoder": one MoE layer, "decoder": two), shared weights from one seed."""
    torch.manual_seed(0)
    layers = [MoELayer(MoELayerConfig(D, H, E), seed=10 + i, group=group) for i in range(3)]
    return [layers[:1], layers[1:]]


def run_stack(stack, x):
    for layer in stack:
        x = x + layer(x)
    return x


# What each worker runs: (stack, tokens) calls in its own order; worker 2 has nothing at all.
# fmt: off
PLANS = [
    [(0, 5), (1, 5), (1, 4), (1, 3), (1, 1), (0, 2), (1, 2)],
    [(0, 7), (1, 7), (0, 3), (1, 3), (1, 3), (1, 3), (1, 3), (1, 2), (1, 1)],
    [],
]
# fmt: on


def inputs(rank, call):
    return torch.randn(PLANS[rank][call][1], D, generator=torch.Generator().manual_seed(100 * rank + call))


def lockstep_worker(rank, world):
    stacks = build_stacks(dist.group.WORLD)
    lockstep = LockStep(stacks, dist.group.WORLD)
    outputs = []
    with torch.no_grad(), lockstep.session():
        for call, (stack, _) in enumerate(PLANS[rank]):
            lockstep.before(stack)
            outputs.append(run_stack(stacks[stack], inputs(rank, call)))
    return outputs


def test_workers_making_different_numbers_of_moe_calls_equal_one_process():
    results = run_on_workers(lockstep_worker, 3)
    reference = build_stacks(None)
    for rank, outputs in enumerate(results):
        assert len(outputs) == len(PLANS[rank])
        for call, (stack, _) in enumerate(PLANS[rank]):
            with torch.no_grad():
                want = run_stack(reference[stack], inputs(rank, call))
            torch.testing.assert_close(outputs[call], want, rtol=0, atol=1e-6)


def stalled_peer(rank, world):
    """Worker 1 enters the session, then stops answering while worker 0 still decodes."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))  # what --moe-comm-timeout 3 makes
    stacks = build_stacks(group)
    lockstep = LockStep(stacks, group)
    with torch.no_grad(), lockstep.session():
        lockstep.before(0)
        run_stack(stacks[0], torch.randn(3, D))
        if rank == 1:
            time.sleep(8)  # past the 3 s timeout, then it gives up too
        for _ in range(5):
            lockstep.before(1)
            run_stack(stacks[1], torch.randn(3, D))
    return "done"


def test_a_worker_stalling_mid_generation_fails_its_peer_with_an_error_not_a_hang():
    started = time.monotonic()
    survivor, _ = run_workers_through_faults(stalled_peer, 2, deadline=60)
    assert survivor is not None and survivor.get("error") == "MoECommunicationError", survivor
    assert "peer worker died or stalled" in survivor["message"]
    assert survivor["at"] - started < 45
