"""Expert-aware data parallelism: what is shared, how expert gradients line up.

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
* Shared parameters must agree across workers before training starts; they are compared once and a
  mismatch is an error (with ``legacy_ddp`` nothing would ever re-synchronise them).

The gradient norm over both kinds is ``grad_norm.py``'s.
"""

from typing import Iterable, List

import torch
import torch.distributed as dist
from fairseq.distributed import ModuleProxyWrapper

from ..common.refusal import MoEOptionError, MoESetupError
from ..common.torch_compat import foreach_mul_
from ..moe.collective_device import collective_device, on_group_device
from ..moe.comm import collective
from ..moe.experts import is_expert  # noqa: F401  (re-exported: expert_grads.is_expert)
from ..options.model import EXPERT_GRAD_NORMALIZATIONS  # noqa: F401  (--moe-normalize-expert-grad's choices)
from .fully_sharded import is_sharded, local_part

SUPPORTED_DDP_BACKENDS = ("legacy_ddp", "no_c10d", "c10d", "pytorch_ddp", "fully_sharded")


def has_experts(module: torch.nn.Module) -> bool:
    return any(is_expert(p) for p in module.parameters())


def expert_parameter_names(module: torch.nn.Module) -> List[str]:
    return [name for name, p in module.named_parameters() if is_expert(p)]


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
    wrapped (None: no replicas). ``expert_grad_factor``: ``ParallelPlan.expert_grad_factor``, 1 for the
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
