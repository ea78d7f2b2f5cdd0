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
* Inside ``summing_collector()`` (the MoE criterions open it around the model's forward) the layers leave
  it to the collector to sum the losses' gradients over the workers: each record names the group to sum
  over (``MoEAux.collector_sums_over``) and the collector sums each worker's weight of the losses there once
  per forward (``comm.weight_summed_over_ranks``), where each layer would otherwise sum its statistics'
  gradients in its backward, one collective per layer.
* Records made while autograd runs a backward pass come from activation checkpointing
  recomputing the forward; their losses were already counted in the first pass, so they are
  dropped.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch

from ..common.refusal import MoERefusal
from .torch_compat import current_graph_task_id


@dataclass
class MoEAux:
    balance_loss: torch.Tensor  # scalar, differentiable
    z_loss: torch.Tensor  # scalar, differentiable
    stats: Dict[str, torch.Tensor] = field(default_factory=dict)  # detached, this worker's counts
    # The group over which whoever adds these losses must sum each worker's weight of them (the layer did not
    # sum their gradients in backward: summing_collector); None: nothing left to sum.
    collector_sums_over: Any = None


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
        self.collector_sums = False  # inside summing_collector()

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

    @contextmanager
    def summing_collector(self):
        """Inside, the layers leave the sum over workers of their losses' gradients to whoever collects the
        records: only for a collector that sums (``MoEAux.collector_sums_over``)."""
        before, self.collector_sums = self.collector_sums, True
        try:
            yield self
        finally:
            self.collector_sums = before

    def record(self, layer: str, aux: MoEAux) -> None:
        if inside_backward() or (self.scoped and not self._open_passes):
            return
        self._records.append(MoERecord(layer, aux))

    def collect(self) -> List[MoERecord]:
        records, self._records = self._records, []
        return records

    def __len__(self):
        return len(self._records)
