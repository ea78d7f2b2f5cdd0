"""The expert-parallel layout of a process and the groups made from it.

Where the experts of models built now live (``expert_layout``: W, P and this worker's rank) and the
process groups a layout needs: the expert-parallel group (tokens reach their experts by all-to-all
within it), the replica group (expert gradients are summed over it) and the statistics group (the
whole world: routing statistics, balance loss and capacity). ``ExpertLayout`` (``moe/expert_layout.py``)
is the arithmetic; this module reads W and P from the process and makes the groups.
"""

import atexit
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

# Re-exported: the layout and the groups made from it are used together (models, checkpoints).
from ..moe.expert_layout import ExpertLayout, default_expert_parallel_size  # noqa: F401
from .process_state import STATE


def set_comm_timeout(seconds: float) -> None:
    """How long an MoE collective waits for a stalled peer before failing (``--moe-comm-timeout``).
    Applies to expert-parallel groups created afterwards."""
    STATE.comm_timeout_s = float(seconds)


@contextmanager
def all_experts_local():
    """Models built inside hold every expert, whatever the world size (generation, evaluation:
    fairseq's generators run a different number of steps per worker, so no worker may wait for
    another's experts)."""
    STATE.all_experts_local_depth += 1
    try:
        yield
    finally:
        STATE.all_experts_local_depth -= 1


def set_expert_parallel_size(size: int) -> None:
    """The P that ``expert_layout`` and the groups use from now on (``--moe-expert-parallel-size``
    or its default, resolved when a model is built)."""
    STATE.expert_parallel_size = int(size)


def expert_world_size() -> int:
    """How many workers share the experts of models built now: 1 in one process or inside
    ``all_experts_local()``, else torch.distributed's world size."""
    if STATE.all_experts_local_depth or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def expert_layout() -> ExpertLayout:
    """This worker's layout as the process state has it now; P is the one the last model build
    resolved (W if none did). Read where a model is built (which records it: ``model_layout``);
    everything that has the model reads the model's."""
    world = expert_world_size()
    if world == 1:
        return ExpertLayout(1, 1, 0)
    return ExpertLayout(world, STATE.expert_parallel_size or world, dist.get_rank())


def model_layout(model: torch.nn.Module) -> ExpertLayout:
    """The layout ``model`` was built with (``MoEModelMixin`` records it as ``model.moe_layout``). A
    model built without MoE layers (a dense ``--arch``) records none: the process's layout, which
    for it is every parameter on every worker."""
    layout = getattr(model, "moe_layout", None)
    return expert_layout() if layout is None else layout


@dataclass(frozen=True)
class ExpertGroups:
    """This worker's process groups for one layout; ``None`` where the group would be one worker
    (``parallel`` when P == 1) or where there is nothing to reduce (``replica`` when W == P)."""

    parallel: Any
    replica: Any
    statistics: Any


def _expert_groups(layout: Optional[ExpertLayout]) -> Optional[ExpertGroups]:
    layout = expert_layout() if layout is None else layout
    if layout.world_size == 1:
        return None
    # A new default group (re-initialised job), another timeout or another P needs new groups.
    key = (id(dist.group.WORLD), STATE.comm_timeout_s, layout.parallel_size)
    if key not in STATE.expert_groups:
        STATE.expert_groups.clear()
        STATE.expert_groups[key] = _new_expert_groups(layout)
    return STATE.expert_groups[key]


def _new_expert_groups(layout: ExpertLayout) -> ExpertGroups:
    """torch's ``new_group`` must be called by every rank for every group, in the same order: every
    rank walks the same list (all EP groups, all replica groups, the world), making each membership
    once. Dedicated groups, even for the world's membership, keep the MoE collectives in their own
    queue, apart from the gradient all-reduces that data-parallel wrappers issue asynchronously."""
    timeout = None if STATE.comm_timeout_s is None else timedelta(seconds=STATE.comm_timeout_s)
    world = tuple(range(layout.world_size))
    wanted = layout.all_parallel_groups() if layout.parallel_size > 1 else []
    wanted += layout.all_replica_groups() if layout.num_replicas > 1 else []
    # fairseq's CLIs never close their process groups; left open, gloo's threads abort the interpreter
    # at exit now and then ("terminate called without an active exception", exit status -6, seen after
    # a 2-worker fairseq-train had finished). Registered once: atexit keeps one entry per call.
    if not STATE.closes_groups_at_exit:
        atexit.register(close_process_groups)
        STATE.closes_groups_at_exit = True
    made = {}
    for ranks in wanted + [world]:
        if ranks not in made:
            made[ranks] = dist.new_group(list(ranks), timeout=timeout)
    return ExpertGroups(
        parallel=made[layout.parallel_group_ranks] if layout.parallel_size > 1 else None,
        replica=made[layout.replica_group_ranks] if layout.num_replicas > 1 else None,
        statistics=made[world],
    )


def close_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def expert_parallel_group(layout: Optional[ExpertLayout] = None):
    """The P workers this worker's experts are sharded over (tokens reach them by all-to-all), or
    ``None`` when every expert is local (P == 1, one process, ``all_experts_local()``). ``layout``:
    the model's (default: the process's, ``expert_layout()``)."""
    groups = _expert_groups(layout)
    return None if groups is None else groups.parallel


def expert_replica_group(layout: Optional[ExpertLayout] = None):
    """The W/P workers holding the same experts as this one (their gradients are summed), or
    ``None`` when there are no replicas (W == P, one process)."""
    groups = _expert_groups(layout)
    return None if groups is None else groups.replica


def moe_statistics_group(layout: Optional[ExpertLayout] = None):
    """Every worker of the job: routing statistics are totalled over it, so the balance loss, z-loss
    and capacity are those of the whole world's batch. ``None`` in one process."""
    groups = _expert_groups(layout)
    return None if groups is None else groups.statistics
