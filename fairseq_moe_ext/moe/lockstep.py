"""Lock-step inference with experts kept on their workers: every worker joins every MoE call.

An MoE layer pairs its collectives by order, so every worker of its group must run the same layer at
the same time. Training does so by construction (one forward per step on every worker); generation
does not: a beam search runs as many decoder steps as its own sentences need, a worker whose share
of the test set ran out runs none. :class:`LockStep` keeps them together.

A model is a list of *stacks* (the encoder's MoE layers, the decoder's), each called as a whole.
Before a real forward through stack ``s`` a worker calls ``before(s)``, and the flags of a *round* ride on
the exchange that the first MoE layer of ``s`` makes anyway (``batch_totals.py``: every worker's counts and
sums, all-gathered): one flag per stack in front of the row tells every worker which stacks someone wants
to run, and is read on the host with the counts, in the layer's one host read. The lowest wanted stack
runs: its wanters go on with the exchange as made (the rows of the others zeroed: they bring no tokens),
every other worker *mirrors* it, calling each of its MoE layers in order with zero tokens (the first with
the round's rows, the others making their own exchanges and joining the all-to-alls), then makes its own
round again. A worker with nothing left to run calls ``finish()``, whose rounds carry no flag and a row of
zeros, mirroring whatever the others run until nobody wants anything, then every worker leaves at once.
Each round lets at least one worker make progress, so it ends. A round costs no collective of its own:
every exchange of a round has the same size (the widest first layer's row), so any worker's round pairs
with any other's, whichever stack each is in.

Results do not depend on who ran with whom as long as routing is dropless: a token's output is its
own experts' function of it alone (a capacity would make it depend on the other workers' tokens).

Torch only, no fairseq imports. ``group``: every worker whose MoE layers talk to this one's (the
layers' statistics group; ``None`` is one process, where nothing needs synchronising).
"""

from contextlib import contextmanager
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

from . import comm
from .batch_totals import row_width
from .collective_device import collective_device


class LockStep:
    def __init__(self, stacks: Sequence[Sequence[nn.Module]], group=None):
        """``stacks``: per stack, its MoE layers (``MoELayer``) in call order."""
        self.stacks: List[List[nn.Module]] = [list(stack) for stack in stacks]
        self.group = group
        self.active = False  # rounds run only while active (see session)
        self.checked = False  # every layer's set-up check made (_check_layers_once)
        firsts = [stack[0] for stack in self.stacks]
        self.width = max(row_width(layer.num_experts, layer.k) for layer in firsts)  # every round's row
        self.count_columns = max(layer.num_experts * layer.k for layer in firsts)  # read on the host

    def before(self, stack: int) -> None:
        """Call right before a real forward through ``stack``: the round rides on its first MoE layer's
        exchange, which returns once every worker runs it (``exchange``)."""
        if not self.active or self.group is None:
            return
        self._check_layers_once()
        for index, layers in enumerate(self.stacks):
            layers[0].lockstep_round = (self, stack) if index == stack else None

    def exchange(self, row: torch.Tensor, stack: int):
        """The first MoE layer of ``stack``, armed by ``before``: its exchange of ``row`` as a round, repeated
        (mirroring the stack the others chose) until the others run this stack too. Returns the layer's
        ``(rows, host_counts)`` (``batch_totals.batch_totals``)."""
        while True:
            chosen, rows, host_counts = self._round(stack, row)
            if chosen == stack:
                return rows, host_counts
            self._mirror(chosen, rows, host_counts)

    def finish(self) -> None:
        """Mirror the other workers' MoE calls until none of them has any left; collective."""
        if self.group is None:
            return
        self._check_layers_once()
        while True:
            chosen, rows, host_counts = self._round(None, None)
            if chosen is None:
                return
            self._mirror(chosen, rows, host_counts)

    @contextmanager
    def session(self):
        """Rounds on inside; on leaving, wait (mirroring) until every worker has left its session."""
        self.active = True
        try:
            yield self
            self.finish()
        finally:
            self.active = False
            for layers in self.stacks:
                layers[0].lockstep_round = None

    def _check_layers_once(self) -> None:
        """Every layer's one-off set-up check (a collective on its first call), in one order on every worker before
        its first round: a worker's first call of a layer may otherwise meet another's round, in another stack."""
        if not self.checked:
            for layers in self.stacks:
                for layer in layers:
                    layer._check_group_once()
            self.checked = True

    def _round(self, wanted: Optional[int], row: Optional[torch.Tensor]):
        """One exchange of ``[flags | row, zero-padded]``: ``(the stack chosen or None, the rows for its first
        layer, their counts on the host)``, the rows of the workers that did not want it zeroed."""
        stacks = len(self.stacks)
        device = collective_device(self.group) if row is None else row.device
        flags = torch.zeros(stacks, dtype=torch.float64, device=device)
        if wanted is not None:
            flags = (torch.arange(stacks, device=device) == wanted).double()  # no host-to-device copy
        mine = flags.new_zeros(stacks + self.width)
        mine[:stacks] = flags
        if row is not None:
            mine[stacks : stacks + row.numel()] = row
        gathered = comm.all_gather_row(mine, self.group)
        # The round's one host read, with every worker's counts: the layer reads them here, not again.
        host = gathered[:, : stacks + self.count_columns].tolist()
        chosen = next((s for s in range(stacks) if any(worker[s] > 0 for worker in host)), None)
        if chosen is None:
            return None, None, None
        first = self.stacks[chosen][0]
        width, counts = row_width(first.num_experts, first.k), first.num_experts * first.k
        joined = (gathered[:, chosen : chosen + 1] > 0).double()  # on the device: who brings tokens to it
        rows = gathered[:, stacks : stacks + width] * joined
        host_counts = [w[stacks : stacks + counts] if w[chosen] > 0 else [0.0] * counts for w in host]
        return chosen, rows, host_counts

    def _mirror(self, stack: int, rows: torch.Tensor, host_counts) -> None:
        with torch.no_grad():
            for index, layer in enumerate(self.stacks[stack]):
                # No rows, in the dtype the others' rows have: the layer's shared (router) weights'
                # (under fully_sharded with --bf16/--fp16 the experts' own weights stay fp32).
                shared = [p for p in layer.parameters() if not getattr(p, "expert", False)]
                like = shared[0] if shared else next(layer.experts.parameters())
                given = (rows.to(like.device), host_counts) if index == 0 else None
                layer.route_tokens(like.new_zeros(0, layer.model_dim), exchanged=given)
