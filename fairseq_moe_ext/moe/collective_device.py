"""Which device a process group's collectives take their tensors on, and the error for a tensor
on any other device.

A process group serves the device types it has a backend for: ``gloo`` serves cpu and cuda, plain
``nccl`` (what fairseq initialises on GPUs) serves cuda only, ``cuda:gloo`` cuda only, and a mixed
``cpu:gloo,cuda:nccl`` both. A tensor on a device the group does not serve fails inside torch with
"No backend type associated with device type cpu": a device mismatch in this plugin, not a dead
peer, so it gets its own exception and never the "restart the job" advice.

Torch only, no fairseq imports. ``group=None`` here means the default group, as in torch.
"""

import re
from typing import Iterable, Tuple

import torch
import torch.distributed as dist

# What torch's backends say when handed a tensor on a device they do not serve.
_DEVICE_MISMATCH = re.compile(
    r"No backend type associated with device type|Tensors? must be CUDA|expected .*device", re.IGNORECASE
)


class MoECollectiveDeviceError(RuntimeError):
    """A collective of an MoE layer got a tensor on a device its process group does not serve: a bug
    in fairseq-moe-ext, not a failed worker."""


def group_device_types(group=None) -> Tuple[str, ...]:
    """Device types ``group`` has a backend for, in the order of its backend config."""
    config = dist.get_backend_config(group)  # "cuda:nccl", "cpu:gloo,cuda:gloo", "cpu:gloo,cuda:nccl"
    types = []
    for entry in config.split(","):
        entry = entry.strip()
        if ":" in entry:
            types.append(entry.split(":", 1)[0])
        else:  # a bare backend name: the devices torch registers it for
            types.extend(dist.Backend.backend_capability.get(entry, ["cpu"]))
    return tuple(dict.fromkeys(types))


def current_device_of_type(device_type: str) -> torch.device:
    if device_type == "cuda":
        # fairseq pins each worker to its GPU with torch.cuda.set_device; NCCL expects that one.
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def collective_device(group=None) -> torch.device:
    """Where to build a tensor that exists only to be communicated over ``group`` (counts, flags,
    fingerprints): the CPU when the group has a CPU backend (no copy to or from the host at all),
    else this worker's current accelerator."""
    types = group_device_types(group)
    if "cpu" in types or not types:
        return torch.device("cpu")
    return current_device_of_type(types[0])


def on_group_device(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` itself when ``group`` serves its device (always, for the layer's own data on a
    real job), else a copy on ``collective_device(group)``."""
    if tensor.device.type in group_device_types(group):
        return tensor
    return tensor.to(collective_device(group))


def device_mismatch_error(
    what: str, tensors: Iterable[torch.Tensor], group, detail: str = ""
) -> MoECollectiveDeviceError:
    devices = ", ".join(sorted({str(t.device) for t in tensors})) or "unknown"
    served = ", ".join(group_device_types(group))
    said = f" ({detail})" if detail else ""
    return MoECollectiveDeviceError(
        f"MoE {what} was handed a tensor on {devices} but its process group's backend is "
        f"'{dist.get_backend_config(group)}', which serves {served} tensors only{said}: this is a device "
        f"mismatch bug in fairseq-moe-ext, not a failed worker; running again fails the same way, so "
        f"report it with this message"
    )


def check_served(what: str, tensors: Iterable[torch.Tensor], group) -> None:
    tensors = list(tensors)
    served = group_device_types(group)
    if any(t.device.type not in served for t in tensors):
        raise device_mismatch_error(what, tensors, group)


def is_device_mismatch(error: BaseException) -> bool:
    return bool(_DEVICE_MISMATCH.search(str(error)))
