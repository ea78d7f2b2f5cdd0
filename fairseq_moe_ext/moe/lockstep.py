"""Lock-step inference with experts kept on their workers: every worker joins every MoE call.

An MoE layer pairs its collectives by order, so every worker of its group must run the same layer at
the same time. Training does so by construction (one forward per step on every worker); generation
does not: a beam search runs as many decoder steps as its own sentences need, a worker whose share
of the test set ran out runs none. :class:`LockStep` keeps them together.

A model is a list of *stacks* (the encoder's MoE layers, the decoder's), each called as a whole.
Before a real forward through stack ``s`` a worker calls ``before(s)``: one all-reduce of a flag
vector (one entry per stack) tells every worker which stacks someone wants to run. The lowest
wanted stack runs: its wanters for real, every other worker *mirrors* it, calling each of its MoE
layers in order with zero tokens (they still exchange counts and join the all-to-alls). A worker
with nothing left to run calls ``finish()``, which mirrors whatever the others run until nobody
wants anything, then every worker leaves at once. Each round lets at least one worker make
progress, so it ends; it costs one small all-reduce per stack forward (per decoder step).

Results do not depend on who ran with whom as long as routing is dropless: a token's output is its
own experts' function of it alone (a capacity would make it depend on the other workers' tokens).

Torch only, no fairseq imports. ``group``: every worker whose MoE layers talk to this one's (the
layers' statistics group; ``None`` is one process, where nothing needs synchronising).
"""

from contextlib import contextmanager
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .collective_device import collective_device
from .comm import collective


class LockStep:
    def __init__(self, stacks: Sequence[Sequence[nn.Module]], group=None):
        """``stacks``: per stack, its MoE layers (``MoELayer``) in call order."""
        self.stacks: List[List[nn.Module]] = [list(stack) for stack in stacks]
        self.group = group
        self.active = False  # rounds run only while active (see session)

    def before(self, stack: int) -> None:
        """Call right before a real forward through ``stack``: returns once every worker runs it."""
        if not self.active or self.group is None:
            return
        while True:
            chosen = self._round(stack)
            if chosen == stack:
                return
            self._mirror(chosen)

    def finish(self) -> None:
        """Mirror the other workers' MoE calls until none of them has any left; collective."""
        if self.group is None:
            return
        while True:
            chosen = self._round(None)
            if chosen is None:
                return
            self._mirror(chosen)

    @contextmanager
    def session(self):
        """Rounds on inside; on leaving, wait (mirroring) until every worker has left its session."""
        self.active = True
        try:
            yield self
            self.finish()
        finally:
            self.active = False

    def _round(self, wanted: Optional[int]) -> Optional[int]:
        flags = torch.zeros(len(self.stacks), dtype=torch.int64, device=collective_device(self.group))
        if wanted is not None:
            flags[wanted] = 1
        with collective("all-reduce of lock-step inference flags", self.group, [flags]):
            dist.all_reduce(flags, group=self.group)
        # One host read per round: which layers run next decides this worker's control flow.
        wanted_by_anyone = [i for i, n in enumerate(flags.tolist()) if n > 0]
        return wanted_by_anyone[0] if wanted_by_anyone else None

    def _mirror(self, stack: int) -> None:
        with torch.no_grad():
            for layer in self.stacks[stack]:
                # No rows, in the dtype the others' rows have: the layer's shared (router) weights'
                # (under fully_sharded with --bf16/--fp16 the experts' own weights stay fp32).
                shared = [p for p in layer.parameters() if not getattr(p, "expert", False)]
                like = shared[0] if shared else next(layer.experts.parameters())
                layer.route_tokens(like.new_zeros(0, layer.model_dim))
