"""The gradient norm under every backend: sqrt(shared norm^2 + each expert's norm^2 counted once).

Every worker computes the same number (the single-process norm), so clipping never makes workers
diverge and fairseq's consistency check holds. The shared part is summed over the data-parallel
group where it is sharded (``--ddp-backend fully_sharded``: each worker a slice of each shared
gradient), the experts' over the expert-parallel group (each expert once: the replicas hold the
same gradients by then), a worker's slices of experts sharded over their replica group
(``--moe-fully-sharded-experts sharded``) over that group first.
"""

from typing import Dict, Iterable, List

import torch
import torch.distributed as dist

from ..common.torch_compat import foreach_mul_
from ..moe.collective_device import on_group_device
from ..moe.comm import collective
from ..moe.experts import is_expert
from .fully_sharded import is_sharded, local_part


def global_grad_norm(params: Iterable[torch.Tensor], group=None) -> torch.Tensor:
    """sqrt(shared norm^2 + each expert's norm^2 counted once), identical on every worker.

    Called after ``ExpertParallelModel.all_reduce_grads`` (fairseq's Trainer: all-reduce, multiply,
    clip), when every replica of an expert holds the same gradient: the expert part is summed over
    the expert-parallel group alone, which holds each expert once (over the world, an expert with
    R replicas would count R times).

    Everything stays on the gradients' device (fp64 sums, in parameter order) and the expert part
    is all-reduced on the group's device: no host read at all, where a ``.cpu()`` per parameter
    used to stall the GPU once per parameter per step. ``group``: ``ParallelPlan.parallel_group`` of the
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


def sharded_grad_norm_squared(grads: List[torch.Tensor], device) -> torch.Tensor:
    """Sum of squares of sharded gradients over the whole tensors: each worker's slices, summed over
    the group their mesh shards them over (one all-reduce per distinct group). fp64, on ``device``."""
    by_group: Dict[object, torch.Tensor] = {}
    for grad in grads:
        group = grad.device_mesh.get_group()
        sq = torch.linalg.vector_norm(grad.to_local(), dtype=torch.float32).double().to(device) ** 2
        by_group[group] = by_group.get(group, torch.zeros((), dtype=torch.float64, device=device)) + sq
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group, sq in by_group.items():
        with collective("all-reduce of sharded gradient norms", group, [sq]):
            dist.all_reduce(sq, group=group)
        total = total + sq
    return total
