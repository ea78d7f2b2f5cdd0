"""Experts sharded over their replica group: ``--ddp-backend fully_sharded --moe-fully-sharded-experts sharded``.

With W workers and expert-parallel size P < W, the W/P workers of a replica group hold the same E/P
experts (``ExpertLayout``). Here each MoE layer's routed experts (the ``BatchedExperts`` marked
``expert``; shared experts are shared parameters, sharded over the world with their layer) become an
FSDP2 unit of their own over that group (not over the world, as the shared part is): its stacked
tensors are cut along dim 0
(the local experts, torch.chunk's split), so each worker holds 1/(W/P) of its experts' parameters,
gradients and optimizer state. FSDP2 gathers one MoE layer's E/P experts for that layer's forward and
again for its backward, and frees them after each (the fairseq ``nllb`` branch wraps each expert in
FSDP over its replica group the same way; torchtitan gives experts a mesh of their own).

What stays as it was with experts whole (``expert_grads.py``, ``grad_norm.py``):

* Scaling: the reduce-scatter *sums* over the replica group (divide factor 1, sum-only collectives),
  what ``sum_expert_grads_over_replicas`` did with an all-reduce, and an expert with no gradient on
  one worker counts as zeros there too; ``ExpertParallelModel.all_reduce_grads`` then multiplies by
  ``expert_grad_factor / world_size`` as for every backend (``--moe-normalize-expert-grad``).
* The gradient norm: the squares of a worker's slices are summed over the replica group (each expert
  once per expert-parallel rank), then over the expert-parallel group (``global_grad_norm``).
* Precision: the shared part's policy (fp32 shards, gathered in fp16/bf16, reduced in fp32).
* The ``expert`` marker: FSDP2 replaces each parameter with a sharded one; the marker is put back.
* Saving and loading: a gathered expert tensor is kept by the first worker of its replica group (the
  one that writes the rank file), so a set is the ordinary set (``fully_sharded.full_tensors``);
  loading cuts each worker's slice out of the E/P experts its rank file holds.

With W == P there is no replica group and nothing changes. Only under fully_sharded (checked in
``fairseq_integration/sharding.py``).
"""

from typing import List

import torch

from ..common.refusal import MoESetupError
from ..common.torch_compat import forget_forward_records
from ..moe.experts import BatchedExperts, is_expert

SHARDED = "sharded"
# FSDP2 setters this module needs; newer than fully_shard itself (torch 2.13 has them; whether torch
# 2.11 has them is unverified here), so they are checked before any expert is sharded.
NEEDED_SETTERS = ("set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params")


def refuse_torch_without_setters(fsdp_module_type) -> None:
    missing = [name for name in NEEDED_SETTERS if not hasattr(fsdp_module_type, name)]
    if missing:
        raise MoESetupError(
            f"--moe-fully-sharded-experts sharded needs FSDP2's {' and '.join(missing)}, which torch "
            f"{torch.__version__} lacks: upgrade torch (2.13 has them) or use --moe-fully-sharded-experts whole"
        )


def expert_modules(model: torch.nn.Module) -> List[BatchedExperts]:
    """The MoE layers' routed experts: the ``BatchedExperts`` whose parameters carry the ``expert`` marker.
    Shared experts (``moe/shared_experts.py``) are a ``BatchedExperts`` too, but shared parameters: every
    worker holds them and their gradient is averaged over the world, so they stay in their layer's unit,
    sharded over the world like the rest of it. Taken by their module type they were sharded over the
    replica group and their gradient summed there, never averaged (W times too large when P = 1)."""
    return [m for m in model.modules() if isinstance(m, BatchedExperts) and all(map(is_expert, m.parameters()))]


def shard_experts(model: torch.nn.Module, replica_group, mp_policy=None) -> int:
    """Apply FSDP2 over ``replica_group`` to every MoE layer's experts, in place, before the shared
    part is sharded (an inner FSDP2 unit is left out of the outer ones). Returns how many units."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    refuse_torch_without_setters(FSDPModule)
    modules = expert_modules(model)
    if not modules:
        return 0
    device = next(modules[0].parameters()).device
    mesh = DeviceMesh.from_group(replica_group, device.type)
    options = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for module in modules:
        marked = {name for name, p in module.named_parameters(recurse=False) if is_expert(p)}
        fully_shard(module, reshard_after_forward=True, **options)
        # Summed over the replicas, not averaged: all_reduce_grads scales experts for every backend.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        module.set_reduce_scatter_unused_params(True)  # an expert without gradient: zeros, as before
        for name, p in module.named_parameters(recurse=False):
            if name in marked:
                p.expert = True
    return len(modules)


def keeps_gathered(tensor) -> bool:
    """Does this worker keep ``tensor`` (sharded) once gathered for a save? The first worker of the
    group it is sharded over: rank 0 for the shared part (sharded over the world), the worker of the
    first replica, which writes the rank file, for experts sharded over their replica group."""
    return tensor.device_mesh.get_local_rank() == 0


def forget_forward_order(modules) -> None:
    """FSDP2 records each unit's forward to prefetch in the next backward, and forgets them only after
    a backward. Generation runs forwards with no backward, a different number on each worker, and a
    worker done early runs only the MoE layers (joining the others' calls): left recorded, the next
    training backward prefetches a different unit on each worker and waits forever (seen: --eval-bleu
    with experts sharded). Called when generation ends; torch 2.13's FSDP2 state has no public reset: the
    private record is reached through common/torch_compat.py (checked before generation starts)."""
    forget_forward_records(modules)
