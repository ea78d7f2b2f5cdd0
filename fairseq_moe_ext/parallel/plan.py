"""How a model is spread over its workers, as one value: ``ParallelPlan``.

A plan is decided once, when a model is built (``ParallelPlan.for_model``: the world, this worker's rank,
``--moe-expert-parallel-size`` resolved against the workers and each side's experts, the backend, whether
fully_sharded shards the experts too, its wrapping unit, the expert gradients' normalisation and the MoE
collectives' timeout), kept on the model (``model.parallel_plan``) and read from it by everything that
later has the model: the data-parallel wrapper, FSDP2, saving, loading, generation (``plan_of``). Nothing
reads W or P from process state any more.

The plan makes its process groups when first asked (``groups``), through the process's group cache
(``process_state.ProcessGroups``: torch's ``new_group`` is collective and every worker must make the same
groups in the same order, so plans of the same layout share them). One process, or a model built with
every expert local (generation), has no groups: ``ParallelPlan()`` is W = P = 1.

The arithmetic of the layout (which worker holds which experts, the valid P's) is ``moe/expert_layout.py``'s,
below the checkpoint tier that needs it too.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..moe.expert_layout import ExpertLayout, default_expert_parallel_size, parallel_size_refusal
from ..options import moe_options
from ..options.sides import expert_sides, sides_of
from .process_state import STATE


@dataclass(frozen=True)
class ExpertGroups:
    """This worker's process groups for one layout; ``None`` where the group would be one worker
    (``parallel`` when P == 1) or where there is nothing to reduce (``replica`` when W == P)."""

    parallel: Any
    replica: Any
    statistics: Any


# fmt: off
@dataclass(frozen=True)
class ParallelPlan:
    world_size: int = 1  # W: the workers that train (or generate) together; 1 with every expert local
    parallel_size: int = 1  # P: the workers each MoE layer's experts are spread over (E/P each)
    rank: int = 0  # this worker's rank in the world
    backend: str = "legacy_ddp"  # --ddp-backend
    experts: str = "whole"  # --moe-fully-sharded-experts: "sharded" cuts them over their replica group too
    fsdp_unit: str = "layer"  # --moe-fully-sharded-unit
    expert_grad_normalization: str = "world_size"  # --moe-normalize-expert-grad
    comm_timeout_s: Optional[float] = None  # --moe-comm-timeout (None: torch's default)
# fmt: on

    def __post_init__(self):
        self.layout  # noqa: B018  (refuses a P that does not divide W, or a rank outside the world)

    @property
    def layout(self) -> ExpertLayout:
        return ExpertLayout(self.world_size, self.parallel_size, self.rank)

    @property
    def fully_sharded(self) -> bool:
        return self.backend == "fully_sharded"

    @property
    def experts_sharded(self) -> bool:
        """Are this model's experts FSDP2 units over their replica group (fully_sharded, the flag, W > P)?"""
        return self.fully_sharded and self.experts == "sharded" and self.layout.num_replicas > 1

    @property
    def expert_grad_factor(self) -> float:
        """What expert gradients are multiplied by relative to the exact (one-process) gradient: 1 for
        ``world_size``, sqrt(P) for ``sqrt_world_size`` (the nllb branch divides them by sqrt(W / replicas)
        = sqrt(P) where ``world_size`` divides by P)."""
        return self.parallel_size**0.5 if self.expert_grad_normalization == "sqrt_world_size" else 1.0

    def groups(self) -> Optional[ExpertGroups]:
        """This worker's groups for the plan (made on first use, by every worker); None in one process."""
        if self.world_size == 1:
            return None
        return STATE.process_groups.expert_groups(self.layout, self.comm_timeout_s, _new_expert_groups)

    @property
    def parallel_group(self):
        """The P workers this worker's experts are sharded over (tokens reach them by all-to-all), or
        None when every expert is local (P == 1, one process)."""
        groups = self.groups()
        return None if groups is None else groups.parallel

    @property
    def replica_group(self):
        """The W/P workers holding the same experts as this one (their gradients are summed), or None."""
        groups = self.groups()
        return None if groups is None else groups.replica

    @property
    def statistics_group(self):
        """Every worker of the job: routing statistics are totalled over it, so the balance loss, z-loss
        and capacity are those of the whole world's batch. None in one process."""
        groups = self.groups()
        return None if groups is None else groups.statistics

    @classmethod
    def for_model(cls, args, sides, every_expert_local: bool = False) -> "ParallelPlan":
        """The plan of a model built now from ``args`` with MoE layers in ``sides``: W and the rank from
        torch.distributed (1 and 0 in one process or with ``every_expert_local``), P resolved, the rest
        from the flags."""
        world, rank = 1, 0
        if not every_expert_local and dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        values = moe_options(args)
        return cls(
            world_size=world,
            parallel_size=resolve_parallel_size(args, world, sides) if world > 1 else 1,
            rank=rank,
            backend=str(config_value(args, "ddp_backend") or "legacy_ddp"),
            experts=str(values.moe_fully_sharded_experts),
            fsdp_unit=str(values.moe_fully_sharded_unit),
            expert_grad_normalization=str(values.moe_normalize_expert_grad),
            comm_timeout_s=float(values.moe_comm_timeout),
        )


def plan_of(model: torch.nn.Module) -> ParallelPlan:
    """The plan ``model`` was built with (``MoEModelMixin`` keeps it as ``model.parallel_plan``). A model
    without MoE layers (a dense ``--arch``) keeps none: every parameter on every worker, the world's
    workers and this rank, as its data-parallel wrapper sees them."""
    plan = getattr(model, "parallel_plan", None)
    if plan is not None:
        return plan
    if dist.is_available() and dist.is_initialized():
        return ParallelPlan(dist.get_world_size(), dist.get_world_size(), dist.get_rank())
    return ParallelPlan()


def resolve_parallel_size(args, world: int, sides=("encoder", "decoder")) -> int:
    """P for ``world`` workers: --moe-expert-parallel-size, checked, or by default the largest P dividing
    the workers and the experts of each of ``sides`` that holds MoE layers (P = W wherever each E is a
    multiple of W)."""
    counts: Dict[str, int] = {side.experts_flag: side.experts for side in expert_sides(sides_of(args, sides))}
    size = moe_options(args).moe_expert_parallel_size
    if size is None:
        return default_expert_parallel_size(world, *counts.values())
    refusal = parallel_size_refusal(size, world, counts)
    if refusal:
        raise MoEOptionError(refusal)
    return size


def _new_expert_groups(layout: ExpertLayout, timeout_s: Optional[float]) -> ExpertGroups:
    """torch's ``new_group`` must be called by every rank for every group, in the same order: every
    rank walks the same list (all EP groups, all replica groups, the world), making each membership
    once. Dedicated groups, even for the world's membership, keep the MoE collectives in their own
    queue, apart from the gradient all-reduces that data-parallel wrappers issue asynchronously."""
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    world = tuple(range(layout.world_size))
    wanted = layout.all_parallel_groups() if layout.parallel_size > 1 else []
    wanted += layout.all_replica_groups() if layout.num_replicas > 1 else []
    made = {}
    for ranks in wanted + [world]:
        if ranks not in made:
            made[ranks] = dist.new_group(list(ranks), timeout=timeout)
    return ExpertGroups(
        parallel=made[layout.parallel_group_ranks] if layout.parallel_size > 1 else None,
        replica=made[layout.replica_group_ranks] if layout.num_replicas > 1 else None,
        statistics=made[world],
    )
