"""The private torch APIs of data parallelism this package uses, each behind a fallback or a one-line
message (the MoE core's own are in ``moe/torch_compat.py``, whose ``PRIVATE_APIS`` probes both):

* ``torch._foreach_mul_``: scales many gradients in one call. Missing: one ``mul_`` per tensor.
* ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``: keeps experts out of torch
  DDP's broadcast and all-reduce. Missing: the attributes it sets, set here.
* ``GradScaler._per_optimizer_states`` (``stage``, ``found_inf_per_device``): where ``--amp`` records
  another worker's overflow. Missing or changed: a one-line error naming --fp16/--bf16 instead.
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
