"""Expert-aware data parallelism: what is shared, what is not, and how gradients line up.

Shared parameters (attention, embeddings, routers, ...) are replicated: identical on every worker,
gradients averaged. Expert parameters (``p.expert = True``) are owned by one worker each: never
broadcast, never averaged. Tokens reach their experts through the MoE layers' all-to-all, so an
expert's gradient is already the sum over every worker's tokens. Three consequences, handled here:

* fairseq multiplies every gradient by ``world_size / sample_size`` after the all-reduce (which
  averaged the shared ones); expert gradients were never averaged, so they are first divided by
  ``world_size``. The update then equals the single-process update.
* The gradient norm used for clipping and logging is the global one: shared norm squared plus the
  sum over workers of their expert norms squared. Every worker computes the same number, so
  clipping never makes workers diverge and fairseq's consistency check holds.
* Shared parameters must agree across workers before training starts; they are compared once and a
  mismatch is an error (with ``legacy_ddp`` nothing would ever re-synchronise them).
"""

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, List

import torch
import torch.distributed as dist
from fairseq.distributed import ModuleProxyWrapper

from .moe.collective_device import collective_device, on_group_device
from .moe.comm import collective
from .process_state import STATE

SUPPORTED_DDP_BACKENDS = ("legacy_ddp", "no_c10d", "c10d", "pytorch_ddp")


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


def expert_parallel_group():
    """The process group experts are spread over: every worker of the job, or ``None`` in a single
    process (then every expert is local).

    A dedicated group (same members as the default one) keeps the MoE all-to-alls in their own
    queue, separate from the gradient all-reduces that data-parallel wrappers issue asynchronously.
    """
    if STATE.all_experts_local_depth or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    # A new default group (re-initialised job) or another timeout needs a new MoE group.
    key = (id(dist.group.WORLD), STATE.comm_timeout_s)
    if key not in STATE.expert_groups:
        STATE.expert_groups.clear()
        timeout = None if STATE.comm_timeout_s is None else timedelta(seconds=STATE.comm_timeout_s)
        STATE.expert_groups[key] = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
    return STATE.expert_groups[key]


@dataclass(frozen=True)
class ExpertLayout:
    """PROVISIONAL (the expert-parallel size lands separately): P = W."""

    world_size: int
    parallel_size: int
    rank: int

    @property
    def ep_rank(self) -> int:
        return self.rank % self.parallel_size

    @property
    def replica_index(self) -> int:
        return self.rank // self.parallel_size

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.parallel_size


def expert_layout() -> ExpertLayout:
    group = expert_parallel_group()
    if group is None:
        return ExpertLayout(1, 1, 0)
    return ExpertLayout(dist.get_world_size(), dist.get_world_size(group), dist.get_rank())


def expert_parallel_world_size() -> int:
    group = expert_parallel_group()
    return 1 if group is None else dist.get_world_size(group)


def is_expert(p) -> bool:
    return getattr(p, "expert", False) is True


def has_experts(module: torch.nn.Module) -> bool:
    return any(is_expert(p) for p in module.parameters())


def expert_parameter_names(module: torch.nn.Module) -> List[str]:
    return [name for name, p in module.named_parameters() if is_expert(p)]


def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """sqrt(shared norm^2 + sum over workers of expert norm^2), identical on every worker.

    Everything stays on the gradients' device (fp64 sums, in parameter order) and the expert part
    is all-reduced on the group's device: no host read at all, where a ``.cpu()`` per parameter
    used to stall the GPU once per parameter per step."""
    grads = [(p.grad.detach(), is_expert(p)) for p in params if p is not None and p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    shared_sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    for grad, expert in grads:
        sq = torch.linalg.vector_norm(grad, dtype=torch.float32).double().to(device) ** 2
        if expert:
            expert_sq = expert_sq + sq
        else:
            shared_sq = shared_sq + sq
    group = expert_parallel_group()
    if group is not None:
        summed = on_group_device(expert_sq, group)
        with collective("all-reduce of expert gradient norms", group, [summed]):
            dist.all_reduce(summed, group=group)
        expert_sq = summed.to(device)
    return (shared_sq + expert_sq).sqrt().float()


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    total_norm = global_grad_norm(params)
    if max_norm > 0:
        clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp_(max=1)
        grads = [p.grad.detach() for p in params if p is not None and p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
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
            raise RuntimeError(
                f"shared parameter {name} differs between rank 0 and rank {rank} before training: every "
                f"worker must build the model with the same --seed (expert weights are seeded per expert "
                f"and may differ); check for rank-dependent initialisation"
            )


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    bits = p.detach().float().contiguous().view(torch.int32).long().cpu().view(-1)
    position = torch.arange(1, bits.numel() + 1, dtype=torch.long) % 1_000_003
    return torch.stack([bits.sum(), (bits * position).sum(), torch.tensor(bits.numel())])


class ExpertParallelModel(ModuleProxyWrapper):
    """Wraps fairseq's data-parallel model so expert gradients get the matching scale.

    Attribute access, ``state_dict`` and ``load_state_dict`` go to the fairseq model, as with
    fairseq's own wrappers.
    """

    def __init__(self, module: torch.nn.Module, world_size: int):
        super().__init__(module)
        self.world_size = world_size

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    def all_reduce_grads(self):
        inner = getattr(self.module, "module", None)
        if inner is not None and hasattr(inner, "all_reduce_grads"):
            inner.all_reduce_grads()  # legacy_ddp / no_c10d reduce here; c10d did it in backward
        scale = 1.0 / self.world_size
        grads = [p.grad for p in self.parameters() if is_expert(p) and p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale)


def unsupported_backend_error(backend: str) -> ValueError:
    return ValueError(
        f"--ddp-backend {backend} is not supported with MoE models (it would shard or average expert "
        f"parameters): use --ddp-backend legacy_ddp (or c10d / pytorch_ddp)"
    )

