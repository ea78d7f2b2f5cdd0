"""The private torch APIs of data parallelism this package uses, each behind a fallback or a one-line
message (the MoE core's own are in ``moe/torch_compat.py``, whose ``PRIVATE_APIS`` probes both):

* ``torch._foreach_mul_``: scales many gradients in one call. Missing: one ``mul_`` per tensor.
* ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``: keeps experts out of torch
  DDP's broadcast and all-reduce. Missing: the attributes it sets, set here.
* ``GradScaler._per_optimizer_states`` (``stage``, ``found_inf_per_device``): where ``--amp`` records
  another worker's overflow. Missing or changed: a one-line error naming --fp16/--bf16 instead.
* FSDP2's private state (torch 2.13 has no public getter; ``FSDP_PRIVATE_STATE`` names each piece):
  ``FSDPModule._get_fsdp_state()``, its ``_fsdp_param_groups`` (older FSDP2: one ``_fsdp_param_group``),
  and of each group ``post_forward_mesh_info`` (whether it reshards after forward) and the forwards it
  recorded for the next backward's prefetch (``comm_ctx.post_forward_order``, ``_post_forward_indices``).
  Whether a unit reshards after forward falls back to what ``parallel/fully_sharded.shard_model`` set; the
  recorded forwards, which generation inside training must forget (``--eval-bleu`` under fully_sharded),
  are refused in one line before anything is gathered when any piece is missing.
"""

from typing import Dict, List

import torch

from .refusal import MoESetupError


def lookup(path: str):
    """The object at dotted ``path`` under ``torch`` (``"_C._current_graph_task_id"``), or None."""
    value = torch
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def foreach_mul_(tensors: List[torch.Tensor], factor) -> None:
    op = lookup("_foreach_mul_")
    if op is not None:
        op(tensors, factor)
        return
    for t in tensors:
        t.mul_(factor)


def ignore_in_ddp(module: torch.nn.Module, names: List[str]) -> None:
    """torch DDP leaves the parameters and buffers ``names`` of ``module`` alone."""
    setter = getattr(torch.nn.parallel.DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
    if setter is not None:
        setter(module, names)
        return
    module._ddp_params_and_buffers_to_ignore = names
    ignored = set(names)
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if name in ignored:
            tensor._ddp_ignored = True


def has_set_ddp_ignore() -> bool:
    return hasattr(torch.nn.parallel.DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model")


def scaler_optimizer_state(scaler, optimizer) -> Dict:
    """GradScaler's record for ``optimizer`` (``stage``, ``found_inf_per_device``)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    state = None if states is None else states[id(optimizer)]
    if not isinstance(state, dict) or not {"stage", "found_inf_per_device"} <= state.keys():
        raise MoESetupError(
            f"--amp on several MoE workers marks overflows in GradScaler._per_optimizer_states, which torch "
            f"{torch.__version__} lays out differently: use --fp16 or --bf16 instead of --amp"
        )
    return state


def has_scaler_states() -> bool:
    try:
        scaler = torch.amp.GradScaler("cpu")
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        scaler_optimizer_state(scaler, optimizer)
    except Exception:  # noqa: BLE001 - any failure means the layout the plugin reads is not there
        return False
    return True


# FSDP2's private state the plugin reads, in the order it reads it.
FSDP_PRIVATE_STATE = (
    "FSDPModule._get_fsdp_state",
    "FSDPState._fsdp_param_groups",
    "FSDPParamGroup.post_forward_mesh_info",
    "FSDPParamGroup.comm_ctx.post_forward_order",
    "FSDPParamGroup._post_forward_indices",
)
# Set by parallel/fully_sharded.shard_model on each unit: what it asked FSDP2 for (the fallback of the private read).
RESHARD_AFTER_FORWARD = "moe_reshard_after_forward"


def fsdp_param_groups(module) -> List:
    """The FSDP2 parameter groups of ``module`` (one unit), or None where torch lays its state out otherwise."""
    getter = getattr(module, "_get_fsdp_state", None)
    state = getter() if callable(getter) else None
    if state is None:
        return None
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):  # FSDP2 before torch 2.13: at most one group per unit
        return [g for g in [state._fsdp_param_group] if g is not None]
    return None


def fsdp_private_state(module) -> dict:
    """{each of FSDP_PRIVATE_STATE: whether ``module`` (an FSDP2 unit with parameters) has it}, for the GPU
    one-shot's environment line."""
    groups = fsdp_param_groups(module) or []
    return {
        FSDP_PRIVATE_STATE[0]: callable(getattr(module, "_get_fsdp_state", None)),
        FSDP_PRIVATE_STATE[1]: fsdp_param_groups(module) is not None,
        FSDP_PRIVATE_STATE[2]: bool(groups) and all(hasattr(g, "post_forward_mesh_info") for g in groups),
        FSDP_PRIVATE_STATE[3]: bool(groups)
        and all(hasattr(getattr(g, "comm_ctx", None), "post_forward_order") for g in groups),
        FSDP_PRIVATE_STATE[4]: bool(groups) and all(hasattr(g, "_post_forward_indices") for g in groups),
    }


def reshards_after_forward(module) -> bool:
    """Whether FSDP2 frees ``module``'s gathered parameters after its forward: its groups' private
    ``post_forward_mesh_info``, else what shard_model (or the last set_reshard_after_forward) asked for."""
    groups = fsdp_param_groups(module)
    if groups and all(hasattr(g, "post_forward_mesh_info") for g in groups):
        return any(g.post_forward_mesh_info is not None for g in groups)
    return bool(getattr(module, RESHARD_AFTER_FORWARD, True))


def set_reshard_after_forward(module, value: bool) -> None:
    """FSDP2's public setter, and the value remembered for ``reshards_after_forward``'s fallback."""
    module.set_reshard_after_forward(value, recurse=False)
    setattr(module, RESHARD_AFTER_FORWARD, value)


def _forward_records(group):
    comm_ctx = getattr(group, "comm_ctx", None)
    order = getattr(comm_ctx, "post_forward_order", None)
    indices = getattr(group, "_post_forward_indices", None)
    return None if order is None or indices is None else (order, indices)


def check_forward_records(modules, purpose: str) -> None:
    """Refuse ``purpose`` in one line (before anything is gathered) where FSDP2's recorded forwards of
    ``modules`` cannot be reached to be forgotten after it."""
    for module in modules:
        groups = fsdp_param_groups(module)
        if groups is None or any(_forward_records(g) is None for g in groups):
            raise MoESetupError(
                f"{purpose} runs forwards with no backward, which FSDP2 records for the next backward's prefetch, "
                f"and torch {torch.__version__} keeps that record elsewhere than FSDPParamGroup.comm_ctx."
                f"post_forward_order / _post_forward_indices: use --ddp-backend legacy_ddp, or drop it"
            )


def forget_forward_records(modules) -> None:
    """Clear the forwards FSDP2 recorded on ``modules`` (checked by ``check_forward_records``)."""
    for module in modules:
        for group in fsdp_param_groups(module) or []:
            records = _forward_records(group)
            if records is not None:
                for record in records:
                    record.clear()
