"""The loss cache: how auxiliary losses travel from MoE layers to the criterion.

This replaces Tutel's process-global ``system.cache()``. The model owns one cache; each MoE layer
appends a record (its balance loss, z-loss and routing statistics) every time it runs, and the
criterion collects the records of the current forward pass, which clears them.

* A layer that runs twice in one pass leaves two records; both are collected.
* ``start_pass()`` (called by the model at the top of each forward) discards records of an earlier
  pass that nobody collected, e.g. inference, so a later collection never sees stale values. If
  such a record is part of an autograd graph (a training forward whose criterion never collected
  its balance loss) it raises instead: the loss would otherwise be silently lost.
* A ``scoped`` cache (what fairseq models use) records only inside ``forward_pass()``, i.e. during
  the model's own forward; fairseq's generators call the encoder and decoder directly, step after
  step, and nothing from those steps needs to be kept.
* ``router_losses_apply`` (default True) tells the criterion whether the balance loss and z-loss join
  the loss: False where the router is frozen (freeze.py), and they are only logged.
* Records made while autograd runs a backward pass come from activation checkpointing
  recomputing the forward; their losses were already counted in the first pass, so they are
  dropped.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List

import torch

from ..common.refusal import MoERefusal
from .torch_compat import current_graph_task_id


@dataclass
class MoEAux:
    balance_loss: torch.Tensor  # scalar, differentiable
    z_loss: torch.Tensor  # scalar, differentiable
    stats: Dict[str, torch.Tensor] = field(default_factory=dict)  # detached, this worker's counts


@dataclass
class MoERecord:
    layer: str
    aux: MoEAux


class UncollectedMoELossError(MoERefusal, RuntimeError):
    pass


def inside_backward() -> bool:
    # None (torch cannot tell): only checkpointing records inside backward, and it is refused then.
    task = current_graph_task_id()
    return task is not None and task != -1


class MoEAuxCache:
    def __init__(self, scoped: bool = False):
        self._records: List[MoERecord] = []
        self.scoped = scoped
        self._open_passes = 0
        self.router_losses_apply = True

    def start_pass(self) -> None:
        pending = [r for r in self._records if r.aux.balance_loss.requires_grad]
        if pending:
            raise UncollectedMoELossError(
                f"MoE balance losses of {len(pending)} layer run(s) from the previous training "
                "forward pass were never collected, so they would be silently lost: train MoE "
                "models with an MoE criterion (--criterion moe_cross_entropy or "
                "moe_label_smoothed_cross_entropy), or call model.moe_cache.collect() after forward"
            )
        self._records = []

    @contextmanager
    def forward_pass(self):
        self.start_pass()
        self._open_passes += 1
        try:
            yield
        finally:
            self._open_passes -= 1

    def record(self, layer: str, aux: MoEAux) -> None:
        if inside_backward() or (self.scoped and not self._open_passes):
            return
        self._records.append(MoERecord(layer, aux))

    def collect(self) -> List[MoERecord]:
        records, self._records = self._records, []
        return records

    def __len__(self):
        return len(self._records)
