"""How many rows a worker's experts receive in one MoE call: the number that runs a GPU out of
memory. With dropless routing nothing bounds it (a router that sends most tokens to the experts of
one worker sends that worker most rows of every worker's batch); a capacity factor bounds it by
``k * capacity`` per local expert.

Each layer keeps its peak since the last read (``MoELayer.rows_received_peak``, host integers the
layer has anyway, so no extra host sync); ``take_peak`` reads and resets it, ``peak_over_workers``
takes the maximum over the workers with one small all-reduce (the fairseq hooks log it per update).
"""

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .collective_device import collective_device
from .comm import collective
from .layer import MoELayer


def moe_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def take_peak(model: nn.Module) -> int:
    """The most rows one of ``model``'s MoE layers computed on this worker in one call since the
    last take_peak (0 if none ran); resets every layer's peak."""
    peak = 0
    for layer in moe_layers(model):
        peak, layer.rows_received_peak = max(peak, layer.rows_received_peak), 0
    return peak


def peak_over_workers(peak: int, group: Optional[object]) -> int:
    """The largest ``peak`` of any worker of ``group`` (``None``: this one's); collective."""
    if group is None:
        return peak
    value = torch.full((1,), float(peak), dtype=torch.float64, device=collective_device(group))
    with collective("all-reduce of the rows the experts received", group, [value]):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())
