"""The private torch APIs this package uses, each behind a fallback or a one-line message.

The pinned torch is 2.13; a lent GPU machine runs 2.11, and users run others. None of the APIs
below is newer than 2.11, but they are private (no deprecation cycle), so each is looked up by name
when used:

* ``torch._grouped_mm``: the grouped expert GEMM. Missing: ``auto`` keeps the per-expert loop, and
  asking for ``grouped_mm`` by name is refused in one line (``check_grouped_mm``).
* ``torch._C._current_graph_task_id``: tells a record made while backward recomputes a checkpointed
  forward (moe/cache.py). Missing: nothing can tell, so ``--checkpoint-activations`` on MoE layers is
  refused in one line (``check_backward_detection``); without checkpointing it is never needed.
* ``torch._foreach_mul_``: scales many gradients in one call. Missing: one ``mul_`` per tensor.
* ``torch.ops.aten.threshold_backward.grad_input``: ReLU's backward in place. Missing: the same
  ``where(h <= 0, 0, grad)`` as a ``masked_fill_``.
* ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``: keeps experts out of torch
  DDP's broadcast and all-reduce. Missing: the attributes it sets, set here.
* ``GradScaler._per_optimizer_states`` (``stage``, ``found_inf_per_device``): where ``--amp`` records
  another worker's overflow. Missing or changed: a one-line error naming --fp16/--bf16 instead.
* ``torch.distributed.distributed_c10d._get_default_store``: the rendezvous store through which a
  worker that stops tells the others why (moe/stop_notice.py). Missing: the others keep their
  transport error.

``PRIVATE_APIS`` names each with a probe; the GPU one-shot prints which ones the machine's torch has.
"""

from typing import Callable, Dict, List

import torch
from .refusal import MoEOptionError, MoESetupError


def _lookup(path: str):
    """The object at dotted ``path`` under ``torch`` (``"_C._current_graph_task_id"``), or None."""
    value = torch
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def has_grouped_mm() -> bool:
    return _lookup("_grouped_mm") is not None


def check_grouped_mm() -> None:
    if not has_grouped_mm():
        raise MoESetupError(
            f"expert matmul 'grouped_mm' needs torch._grouped_mm, which torch {torch.__version__} lacks: use "
            f"'auto' or 'loop' (FAIRSEQ_MOE_EXPERT_MATMUL=auto), or torch >= 2.8"
        )


def current_graph_task_id():
    """The running backward's task id (-1 outside backward), or None when torch cannot say."""
    probe = _lookup("_C._current_graph_task_id")
    return None if probe is None else probe()


def check_backward_detection() -> None:
    if _lookup("_C._current_graph_task_id") is None:
        raise MoEOptionError(
            f"--checkpoint-activations on MoE layers needs torch._C._current_graph_task_id (to drop the balance "
            f"losses recomputation records twice), which torch {torch.__version__} lacks: drop "
            f"--checkpoint-activations, or use torch >= 2.0"
        )


def foreach_mul_(tensors: List[torch.Tensor], factor) -> None:
    op = _lookup("_foreach_mul_")
    if op is not None:
        op(tensors, factor)
        return
    for t in tensors:
        t.mul_(factor)


def threshold_backward_in_place():
    """aten's ``threshold_backward.grad_input`` overload, or None."""
    try:
        return torch.ops.aten.threshold_backward.grad_input
    except (AttributeError, RuntimeError):
        return None


def relu_backward_(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``grad`` zeroed in place where ``h <= 0`` (ReLU's backward, NaN in ``h`` passing ``grad``)."""
    op = threshold_backward_in_place()
    if op is not None:
        return op(grad, h, 0, grad_input=grad)
    return grad.masked_fill_(h <= 0, 0)


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


def default_store():
    """The default process group's key-value store, or None (no group, or no accessor in this torch)."""
    import torch.distributed as dist

    getter = getattr(getattr(dist, "distributed_c10d", None), "_get_default_store", None)
    if getter is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return getter()
    except Exception:  # noqa: BLE001 - no store means no notice, never a failure
        return None


def _has_scaler_states() -> bool:
    try:
        scaler = torch.amp.GradScaler("cpu")
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        scaler_optimizer_state(scaler, optimizer)
    except Exception:  # noqa: BLE001 - any failure means the layout the plugin reads is not there
        return False
    return True


# name -> probe (True: this torch has it). Read by the GPU one-shot's environment line.
# fmt: off
PRIVATE_APIS: Dict[str, Callable[[], bool]] = {
    "torch._grouped_mm": has_grouped_mm,
    "torch._C._current_graph_task_id": lambda: _lookup("_C._current_graph_task_id") is not None,
    "torch._foreach_mul_": lambda: _lookup("_foreach_mul_") is not None,
    "torch.ops.aten.threshold_backward.grad_input": lambda: threshold_backward_in_place() is not None,
    "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model": lambda: hasattr(
        torch.nn.parallel.DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model"
    ),
    "GradScaler._per_optimizer_states": _has_scaler_states,
    "distributed_c10d._get_default_store": lambda: (
        _lookup("distributed.distributed_c10d._get_default_store") is not None
    ),
}
# fmt: on


def missing_private_apis() -> List[str]:
    return [name for name, probe in PRIVATE_APIS.items() if not probe()]
