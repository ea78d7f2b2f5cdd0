"""``--ddp-backend fully_sharded`` on torch's FSDP2: the shared part sharded, experts expert-parallel.

Shared parameters (attention, embeddings, routers, shared experts, ...) become DTensors sharded on
dim 0 over the data-parallel group (the world): each worker holds 1/W of them, of their gradients
and of the optimizer state built on them. FSDP2 gathers one wrapped unit's parameters for its
forward and backward and reduce-scatters (averages) their gradients during backward. Each layer of
a ``layers`` ModuleList is one unit (an MoE layer is never split across units), the root holds the
rest (embeddings, output projection, final norms).

Expert parameters are listed in FSDP2's ``ignored_params``: they stay plain tensors, E/P per worker,
exactly as under legacy_ddp, and ``ExpertParallelModel.all_reduce_grads`` sums them over their
replica group and scales them, as for every other backend (``--moe-fully-sharded-experts sharded``:
each MoE layer's experts are an FSDP2 unit of their own over that group, ``expert_sharding.py``).

What changes for the rest of training, all here:

* The gradient norm: each worker holds a slice of each shared gradient; the squares of the slices
  are summed over the data-parallel group, the experts' over the expert-parallel group (each expert
  once), so every worker computes the single-process norm.
* Saving: ``full_tensors`` gathers a state dict one tensor at a time (rank 0 keeps each on the CPU,
  the others drop it at once), so a worker's extra memory during a save is one shared tensor, and
  the saved set is an ordinary set (the shared state stored once).
* Loading: ``sharded_like`` cuts this worker's slice out of a full tensor that every worker read,
  with no communication (fairseq and checkpoint/share.py give every worker the shared state).
* Mixed precision (``--bf16``, ``--fp16``): the shards stay fp32 (the optimizer's master weights);
  ``mixed_precision_policy`` gathers each unit in the low precision for its forward and backward and
  reduce-scatters its gradients in fp32. Experts keep fp32 parameters too and compute in the dtype of
  the activations they receive (``BatchedExperts.forward`` casts its weights), so their gradients
  arrive fp32 as well. ``--amp`` keeps fp32 parameters and lets autocast choose per operation.
"""

import sys
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..common.torch_compat import (
    RESHARD_AFTER_FORWARD,
    check_forward_records,
    reshards_after_forward,
    set_reshard_after_forward,
)
from ..moe.experts import is_expert
from .expert_sharding import forget_forward_order

# torch's FSDP2 and DTensor modules take half a second to import: every fairseq CLI imports this
# plugin, so they are imported when a model is sharded, and a tensor can only be a DTensor once
# torch.distributed.tensor has been imported.


def refused_options(args) -> list:
    """One line per option FSDP2 cannot honour here, for an argparse Namespace or a fairseq cfg node
    holding the flags (the MoE architectures check them at parse time, fairseq_integration hook 20 for every model)."""
    refused = []
    if config_value(args, "cpu_offload"):
        refused.append(
            "--cpu-offload is fairscale's and is not supported with --ddp-backend fully_sharded (torch "
            "FSDP2): drop --cpu-offload, or shard over more workers to save memory"
        )
    if config_value(args, "use_sharded_state"):
        refused.append(
            "--use-sharded-state writes fairscale's per-shard files; --ddp-backend fully_sharded (torch "
            "FSDP2) saves an ordinary checkpoint set: drop --use-sharded-state"
        )
    if config_value(args, "store_ema"):
        refused.append(
            "--store-ema keeps a whole copy of the model on every worker, which --ddp-backend "
            "fully_sharded shards: drop --store-ema or use --ddp-backend legacy_ddp"
        )
    for name in [config_value(args, "optimizer"), *(config_value(args, "composite_optimizers") or [])]:
        if str(name) in NOT_ELEMENT_WISE:
            refused.append(
                f"--optimizer {name} {NOT_ELEMENT_WISE[str(name)]}, which a worker's dim-0 slice of a "
                f"shared parameter cannot give under --ddp-backend fully_sharded: use an element-wise "
                f"optimizer (adam, sgd, nag, adagrad, adadelta, adamax) or --ddp-backend legacy_ddp"
            )
    return refused


# fairseq 0.12's optimizers that read more than one element of a tensor at a time (the others, adam,
# sgd, nag, adagrad, adadelta, adamax and cpu_adam, update each element from its own gradient).
NOT_ELEMENT_WISE = {
    "adafactor": "factors its second moment into row and column means and scales updates by whole-tensor RMS",
    "lamb": "scales each update by the ratio of whole-tensor norms (trust ratio)",
}


def low_precision_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype fairseq's Trainer cast ``model`` to (``--fp16``: float16, ``--bf16``: bfloat16, and
    their memory-efficient variants, which fairseq's parser turns on with them), or None (fp32, and
    ``--amp``, where autocast picks the dtype per operation on fp32 parameters)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    low = dtypes & {torch.float16, torch.bfloat16}
    return low.pop() if len(low) == 1 else None


def mixed_precision_policy(dtype: Optional[torch.dtype]):
    """FSDP2's policy for ``dtype``: each unit's parameters gathered in ``dtype`` for forward and
    backward (and its floating inputs cast to it), gradients reduce-scattered in fp32 onto the fp32
    shards the optimizer steps. None for fp32."""
    if dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def zero_sharding_error() -> MoEOptionError:
    return MoEOptionError(
        "--zero-sharding os broadcasts every worker's optimizer shard to the others after each step, "
        "which would make every worker's experts identical: use --ddp-backend fully_sharded (shared "
        "state sharded, experts kept expert-parallel) and drop --zero-sharding"
    )


def is_sharded(tensor) -> bool:
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This worker's slice of a sharded tensor (a view: writing to it writes the shard), or the tensor."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def wrap_units(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The default wrapping: every layer of every ``layers`` ModuleList (encoder and decoder layers),
    outermost first, so that only one layer's shared parameters are gathered at a time."""
    units = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            if not any(module is u or _contains(u, module) for u in units):
                units.extend(module)
    return units


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def check_units_keep_moe_layers_whole(model: torch.nn.Module, units: Iterable[torch.nn.Module]) -> None:
    """A unit inside an MoE layer (its router alone, say) would gather the router for the layer's
    forward while the layer's all-to-all runs outside it: refused."""
    from ..moe.layer import MoELayer

    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            for unit in units:
                if unit is not module and _contains(module, unit):
                    raise MoEOptionError(
                        f"the fully_sharded wrapping puts part of the MoE layer {name} in a unit of its own, "
                        f"which would split the layer across FSDP units: wrap whole transformer layers "
                        f"(the default) or the MoE layer itself"
                    )


def shard_model(
    model: torch.nn.Module,
    group=None,
    units: Optional[List[torch.nn.Module]] = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Apply FSDP2 in place: one unit per layer (``wrap_units``) and the root, over ``group`` (the
    data-parallel group; the world if None), with every expert parameter left out. Returns ``model``
    (now an FSDPModule). ``reshard_after_forward`` applies to the units; the root keeps its
    parameters gathered from its forward to its backward (backward needs them first: the output
    projection), as FSDP2 advises."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise ImportError(
            f"--ddp-backend fully_sharded needs torch >= 2.7 (torch.distributed.fsdp.fully_shard with "
            f"ignored_params), found torch {torch.__version__}: upgrade torch or use --ddp-backend legacy_ddp"
        ) from None
    group = group if group is not None else dist.group.WORLD
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    mesh = DeviceMesh.from_group(group, device.type)
    units = wrap_units(model) if units is None else list(units)
    check_units_keep_moe_layers_whole(model, units)
    options = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for unit in units:
        experts = {p for p in unit.parameters() if is_expert(p)}
        fully_shard(unit, ignored_params=experts, reshard_after_forward=reshard_after_forward, **options)
        setattr(unit, RESHARD_AFTER_FORWARD, reshard_after_forward)  # torch_compat.reshards_after_forward's fallback
    experts = {p for p in model.parameters() if is_expert(p)}
    fully_shard(model, ignored_params=experts, reshard_after_forward=False, **options)
    setattr(model, RESHARD_AFTER_FORWARD, False)
    # Checkpoints hold whole tensors: the root's pre-hook (run before any module loads) cuts them.
    model.register_load_state_dict_pre_hook(_whole_tensors_sliced)
    return model


def fsdp_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


@contextmanager
def gradient_sync_deferred(model: torch.nn.Module):
    """Backward inside accumulates whole gradients on every worker, with no reduce-scatter (the
    micro-batches of ``--update-freq`` but the last); the next backward outside reduce-scatters the
    sum. Costs one whole (reduce-dtype) gradient per shared parameter meanwhile."""
    modules = fsdp_modules(model)
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


@contextmanager
def gathered_for_inference(model: torch.nn.Module):
    """Every shared parameter whole on every worker inside, with no collective from FSDP2: fairseq's
    generators call the encoder and decoder directly (never the root's forward, which gathers the
    embeddings), and workers run different numbers of decoder steps (a unit gathering per call would
    leave them waiting for each other). Costs the whole shared part per worker while inside, what
    legacy_ddp holds all the time; left sharded again at exit."""
    modules = fsdp_modules(model)
    if not modules:
        yield
        return
    check_forward_records(modules, "generation inside training under --ddp-backend fully_sharded (--eval-bleu)")
    saved = [reshards_after_forward(m) for m in modules]
    for module in modules:
        set_reshard_after_forward(module, False)
        module.unshard()
    try:
        yield
    finally:
        for module, reshards in zip(modules, saved):
            module.reshard()
            set_reshard_after_forward(module, reshards)
        forget_forward_order(modules)  # no backward follows these forwards


def _whole_tensors_sliced(module, state_dict, prefix, *args):
    current = module.state_dict()
    for key, like in current.items():
        key = prefix + key
        if is_sharded(like) and key in state_dict and not is_sharded(state_dict[key]):
            state_dict[key] = sharded_like(like, state_dict[key])


def full_tensors(state, keep: Callable[[object], bool]):
    """``state`` (nested dicts and lists) with every sharded tensor replaced by the whole tensor on
    the CPU where ``keep(tensor)`` (the worker that writes it: ``expert_sharding.keeps_gathered``),
    or left out where not: gathered one at a time, in the same order on every worker, so a worker
    holds little extra memory (measured: at most two at once). Plain tensors (steps) stay as they are."""
    if isinstance(state, dict):
        out = {}
        for key, value in state.items():
            value = full_tensors(value, keep)
            if value is not _DROPPED:
                out[key] = value
        return out
    if isinstance(state, (list, tuple)):
        return type(state)(v for v in (full_tensors(v, keep) for v in state) if v is not _DROPPED)
    if is_sharded(state):
        whole = state.full_tensor()
        if not keep(state):
            del whole
            return _DROPPED
        return whole.detach().cpu()  # a new tensor (gathered), moved off the accelerator
    return state


_DROPPED = object()


def sharded_like(like, full: torch.Tensor):
    """This worker's slice of ``full`` laid out as the sharded ``like`` (its mesh, placements,
    dtype and device), cut locally: every worker holds ``full``, so nothing is communicated."""
    if not is_sharded(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=like.to_local().device, dtype=like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def full_optimizer_state(optimizer_state: Dict, keep: Callable[[object], bool]) -> Dict:
    """A torch optimizer state dict (``state`` by parameter index) with sharded states gathered."""
    return {**optimizer_state, "state": full_tensors(optimizer_state.get("state", {}), keep)}


def sharded_optimizer_state(optimizer_state: Dict, params: List[torch.Tensor]) -> Dict:
    """The reverse of ``full_optimizer_state`` for loading: every whole per-parameter state of a
    sharded parameter becomes this worker's slice (0-dim states such as Adam's step stay)."""
    state = {}
    for index, slots in optimizer_state.get("state", {}).items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        state[index] = {
            name: sharded_like(param, value)
            if is_sharded(param) and torch.is_tensor(value) and value.shape == param.shape
            else value
            for name, value in slots.items()
        }
    return {**optimizer_state, "state": state}


def held_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, int]:
    """Bytes this worker holds, by kind: shared parameters, their gradients, their optimizer state,
    and the same for experts (local slices of sharded tensors, as allocated)."""
    counts = dict.fromkeys(
        ["shared_params", "shared_grads", "shared_optimizer", "expert_params", "expert_grads", "expert_optimizer"], 0
    )

    def size(t):
        t = local_part(t)
        return t.numel() * t.element_size()

    for p in model.parameters():
        kind = "expert" if is_expert(p) else "shared"
        counts[f"{kind}_params"] += size(p)
        if p.grad is not None:
            counts[f"{kind}_grads"] += size(p.grad)
        if optimizer is not None:
            for value in optimizer.state.get(p, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    counts[f"{kind}_optimizer"] += size(value)
    return counts


def is_fully_sharded(model: torch.nn.Module) -> bool:
    """Has ``shard_model`` been applied to ``model`` (FSDP2 makes it an FSDPModule)?"""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return fsdp is not None and isinstance(model, fsdp)
