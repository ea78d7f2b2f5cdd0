"""Expert-aware data parallelism: where experts live, what is shared, how gradients line up.

Shared parameters (attention, embeddings, routers, ...) are replicated: identical on every worker,
gradients averaged over the world. Expert parameters (``p.expert = True``) are sharded over an
expert-parallel group of P workers and replicated over the W/P groups (``ExpertLayout``): never
broadcast, and summed only over the replicas of the same experts. Tokens reach their experts
through the MoE layers' all-to-all within the expert-parallel group, so after backward an expert's
gradient is the sum over that group's tokens. Consequences, handled here:

* Summing it over the replica group makes it the sum over every worker's tokens. fairseq then
  multiplies every gradient by ``world_size / sample_size`` (shared ones were averaged), so expert
  gradients are first divided by ``world_size``. The update then equals the single-process update.
  ``--moe-normalize-expert-grad sqrt_world_size`` (the nllb branch's option) divides them by
  ``world_size / sqrt(P)`` instead: sqrt(P) times the exact gradient, as in that branch, where P is
  the expert-parallel size (1 on one process, so the option changes nothing there).
* The gradient norm used for clipping and logging is the global one: shared norm squared plus each
  expert's norm squared counted once (all-reduced over the expert-parallel group only: the
  replicas hold the same gradients by then). Every worker computes the same number, so clipping
  never makes workers diverge and fairseq's consistency check holds.
* Shared parameters must agree across workers before training starts; they are compared once and a
  mismatch is an error (with ``legacy_ddp`` nothing would ever re-synchronise them).
"""

import atexit
import math
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, List, Optional

import torch
import torch.distributed as dist
from fairseq.distributed import ModuleProxyWrapper

from ..common.refusal import MoEOptionError, MoESetupError
from ..common.torch_compat import foreach_mul_
from .fully_sharded import is_sharded, local_part, sharded_grad_norm_squared
from ..moe.collective_device import collective_device, on_group_device
from ..moe.comm import collective

# Re-exported: the layout and the groups made from it are used together (models, checkpoints).
from ..moe.expert_layout import ExpertLayout, default_expert_parallel_size  # noqa: F401
from ..moe.experts import is_expert  # noqa: F401  (re-exported: moe_dist.is_expert)
from ..options.model import EXPERT_GRAD_NORMALIZATIONS  # noqa: F401  (--moe-normalize-expert-grad's choices)
from .process_state import STATE

SUPPORTED_DDP_BACKENDS = ("legacy_ddp", "no_c10d", "c10d", "pytorch_ddp", "fully_sharded")


def expert_grad_factor(normalization: str, parallel_size: int) -> float:
    """What expert gradients are multiplied by relative to the exact (one-process) gradient:
    1 for ``world_size``, sqrt(P) for ``sqrt_world_size`` (the nllb branch divides them by
    sqrt(W / replicas) = sqrt(P) where ``world_size`` divides by P)."""
    return math.sqrt(parallel_size) if str(normalization) == "sqrt_world_size" else 1.0


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


def has_experts(module: torch.nn.Module) -> bool:
    return any(is_expert(p) for p in module.parameters())


def expert_parameter_names(module: torch.nn.Module) -> List[str]:
    return [name for name, p in module.named_parameters() if is_expert(p)]


def global_grad_norm(params: Iterable[torch.Tensor], group=None) -> torch.Tensor:
    """sqrt(shared norm^2 + each expert's norm^2 counted once), identical on every worker.

    Called after ``ExpertParallelModel.all_reduce_grads`` (fairseq's Trainer: all-reduce, multiply,
    clip), when every replica of an expert holds the same gradient: the expert part is summed over
    the expert-parallel group alone, which holds each expert once (over the world, an expert with
    R replicas would count R times).

    Everything stays on the gradients' device (fp64 sums, in parameter order) and the expert part
    is all-reduced on the group's device: no host read at all, where a ``.cpu()`` per parameter
    used to stall the GPU once per parameter per step. ``group``: ``expert_parallel_group()`` of the
    model the parameters belong to (None: every expert local)."""
    grads = [(p.grad.detach(), is_expert(p)) for p in params if p is not None and p.grad is not None]
    device = local_part(grads[0][0]).device if grads else torch.device("cpu")
    # --ddp-backend fully_sharded: each worker holds a slice of each shared gradient.
    shared_sq = sharded_grad_norm_squared([g for g, e in grads if is_sharded(g) and not e], device)
    # --moe-fully-sharded-experts sharded: each worker a slice of its experts, summed over their replica group.
    expert_sq = sharded_grad_norm_squared([g for g, e in grads if is_sharded(g) and e], device)
    for grad, expert in ((g, e) for g, e in grads if not is_sharded(g)):
        sq = torch.linalg.vector_norm(grad, dtype=torch.float32).double().to(device) ** 2
        if expert:
            expert_sq = expert_sq + sq
        else:
            shared_sq = shared_sq + sq
    if group is not None:
        summed = on_group_device(expert_sq, group)
        with collective("all-reduce of expert gradient norms", group, [summed]):
            dist.all_reduce(summed, group=group)
        expert_sq = summed.to(device)
    return (shared_sq + expert_sq).sqrt().float()


# Elements per all-reduce of expert gradients: one bucket for small models, bounded extra memory
# (256 MB of fp32) for large ones.
EXPERT_GRAD_BUCKET_NUMEL = 1 << 26


def sum_expert_grads_over_replicas(params: Iterable[torch.Tensor], group) -> None:
    """Each replica of an expert saw only its expert-parallel group's tokens; summing over ``group``
    (the replica group) gives every replica the gradient of the whole world's tokens.

    Gradients go in flat buckets (per dtype and device, in parameter order, the same on every
    replica), one all-reduce each, not one per parameter. A missing gradient counts as zeros, as in
    fairseq's legacy_ddp, so every replica sends buckets of the same layout."""
    params = [p for p in params if is_expert(p) and p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets = {}
    for p in params:
        kind = buckets.setdefault((p.grad.dtype, p.grad.device), [[]])
        if kind[-1] and sum(g.numel() for g in kind[-1]) + p.grad.numel() > EXPERT_GRAD_BUCKET_NUMEL:
            kind.append([])
        kind[-1].append(p.grad)
    for bucket in (b for kind in buckets.values() for b in kind):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        summed = on_group_device(flat, group)
        with collective("all-reduce of expert gradients over their replicas", group, [summed]):
            dist.all_reduce(summed, group=group)
        summed = summed.to(flat.device)
        offset = 0
        for g in bucket:
            g.copy_(summed[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm_(params, max_norm: float, group=None) -> torch.Tensor:
    """``group``: as for ``global_grad_norm``."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    total_norm = global_grad_norm(params, group)
    if max_norm > 0:
        clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp_(max=1)
        grads = [local_part(p.grad.detach()) for p in params if p is not None and p.grad is not None]
        if grads:
            foreach_mul_(grads, clip_coef.to(grads[0].device))
    return total_norm


def check_shared_parameters_agree(model: torch.nn.Module, group=None) -> None:
    """Raise if any shared parameter differs across workers (bitwise fingerprints)."""
    shared = [(n, p) for n, p in model.named_parameters() if not is_expert(p)]
    if not shared:
        return
    fingerprints = torch.stack([_fingerprint(p) for _, p in shared]).to(collective_device(group))
    gathered = [torch.empty_like(fingerprints) for _ in range(dist.get_world_size(group))]
    with collective("check of shared parameters", group, [fingerprints]):
        dist.all_gather(gathered, fingerprints, group=group)
    gathered = torch.stack(gathered).cpu()  # one host read, once before training
    for rank, other in enumerate(gathered):
        differs = (other != gathered[0]).any(dim=1).nonzero()
        if len(differs):
            name = shared[int(differs[0])][0]
            raise MoESetupError(
                f"shared parameter {name} differs between rank 0 and rank {rank} before training: every "
                f"worker must build the model with the same --seed (expert weights are seeded per expert "
                f"and may differ); check for rank-dependent initialisation"
            )


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    bits = p.detach().float().contiguous().view(torch.int32).long().cpu().view(-1)
    position = torch.arange(1, bits.numel() + 1, dtype=torch.long) % 1_000_003
    return torch.stack([bits.sum(), (bits * position).sum(), torch.tensor(bits.numel())])


class ExpertParallelModel(ModuleProxyWrapper):
    """Wraps fairseq's data-parallel model so expert gradients are summed over their replicas and
    get the matching scale.

    Attribute access, ``state_dict`` and ``load_state_dict`` go to the fairseq model, as with
    fairseq's own wrappers. ``replica_group``: ``expert_replica_group()`` when the model was
    wrapped (None: no replicas). ``expert_grad_factor``: ``expert_grad_factor(...)``, 1 for the
    exact gradient.
    """

    def __init__(self, module: torch.nn.Module, world_size: int, replica_group=None, expert_grad_factor=1.0):
        super().__init__(module)
        self.world_size = world_size
        self.replica_group = replica_group
        self.expert_grad_factor = float(expert_grad_factor)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    def all_reduce_grads(self):
        inner = getattr(self.module, "module", None)
        if inner is not None and hasattr(inner, "all_reduce_grads"):
            inner.all_reduce_grads()  # legacy_ddp / no_c10d reduce here; c10d did it in backward
        experts = [p for p in self.parameters() if is_expert(p)]
        if self.replica_group is not None:  # experts sharded over it were reduce-scattered (summed) by FSDP2
            sum_expert_grads_over_replicas([p for p in experts if not is_sharded(p)], self.replica_group)
        grads = [local_part(p.grad) for p in experts if p.grad is not None]
        if grads:
            foreach_mul_(grads, self.expert_grad_factor / self.world_size)


def unsupported_backend_error(backend: str) -> MoEOptionError:
    return MoEOptionError(
        f"--ddp-backend {backend} is not supported with MoE models (it would shard or average expert "
        f"parameters): use --ddp-backend legacy_ddp (or c10d / pytorch_ddp / fully_sharded)"
    )
