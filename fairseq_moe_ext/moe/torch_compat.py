"""The private torch APIs this package uses, each behind a fallback or a one-line message.

The pinned torch is 2.13; a lent GPU machine runs 2.11, and users run others. None of the APIs
below is newer than 2.11, but they are private (no deprecation cycle), so each is looked up by name
when used:

* ``torch._grouped_mm``: the grouped expert GEMM. Missing: ``auto`` keeps the per-expert loop, and
  asking for ``grouped_mm`` by name is refused in one line (``check_grouped_mm``).
* ``torch._C._current_graph_task_id``: tells a record made while backward recomputes a checkpointed
  forward (moe/cache.py). Missing: nothing can tell, so ``--checkpoint-activations`` on MoE layers is
  refused in one line (``check_backward_detection``); without checkpointing it is never needed.
* ``torch.ops.aten.threshold_backward.grad_input``: ReLU's backward in place. Missing: the same
  ``where(h <= 0, 0, grad)`` as a ``masked_fill_``.
* ``torch.distributed.distributed_c10d._get_default_store``: the rendezvous store through which a
  worker that stops tells the others why (moe/stop_notice.py). Missing: the others keep their
  transport error.

The private APIs of data parallelism (``_foreach_mul_``, torch DDP's ignore list, GradScaler's
per-optimizer state) are in ``common/torch_compat.py``. ``PRIVATE_APIS`` names every one of both with a
probe; the GPU one-shot prints which ones the machine's torch has.
"""

from typing import Callable, Dict, List

import torch

from ..common.refusal import MoEOptionError, MoESetupError
from ..common.torch_compat import has_scaler_states, has_set_ddp_ignore, lookup


def has_grouped_mm() -> bool:
    return lookup("_grouped_mm") is not None


def check_grouped_mm() -> None:
    if not has_grouped_mm():
        raise MoESetupError(
            f"expert matmul 'grouped_mm' needs torch._grouped_mm, which torch {torch.__version__} lacks: use "
            f"'auto' or 'loop' (FAIRSEQ_MOE_EXPERT_MATMUL=auto), or torch >= 2.8"
        )


def current_graph_task_id():
    """The running backward's task id (-1 outside backward), or None when torch cannot say."""
    probe = lookup("_C._current_graph_task_id")
    return None if probe is None else probe()


def check_backward_detection() -> None:
    if lookup("_C._current_graph_task_id") is None:
        raise MoEOptionError(
            f"--checkpoint-activations on MoE layers needs torch._C._current_graph_task_id (to drop the balance "
            f"losses recomputation records twice), which torch {torch.__version__} lacks: drop "
            f"--checkpoint-activations, or use torch >= 2.0"
        )


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


# name -> probe (True: this torch has it). Read by the GPU one-shot's environment line.
# fmt: off
PRIVATE_APIS: Dict[str, Callable[[], bool]] = {
    "torch._grouped_mm": has_grouped_mm,
    "torch._C._current_graph_task_id": lambda: lookup("_C._current_graph_task_id") is not None,
    "torch._foreach_mul_": lambda: lookup("_foreach_mul_") is not None,
    "torch.ops.aten.threshold_backward.grad_input": lambda: threshold_backward_in_place() is not None,
    "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model": has_set_ddp_ignore,
    "GradScaler._per_optimizer_states": has_scaler_states,
    "distributed_c10d._get_default_store": lambda: (
        lookup("distributed.distributed_c10d._get_default_store") is not None
    ),
}
# fmt: on


def missing_private_apis() -> List[str]:
    return [name for name, probe in PRIVATE_APIS.items() if not probe()]
