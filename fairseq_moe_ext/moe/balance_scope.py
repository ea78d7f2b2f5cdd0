"""The balance loss over the global batch (``balance_scope="global-batch"``; Qiu et al. 2025, "Demons in the
Detail: On Implementing Load Balancing Loss for Training Specialized Mixture-of-Expert Models", arXiv
2501.11873).

The balance loss ``E * sum_e P_e * f_e`` weighs each expert's mean router probability ``P_e`` (the part with a
gradient) by its load fraction ``f_e`` (the share of tokens whose first choice is ``e``, a count: no
gradient). With ``micro-batch`` scope both are this micro-batch's, over every worker of the statistics group:
with ``--update-freq N`` each micro-batch is pushed to balance on its own, which works against experts
specialising on domains that arrive in different micro-batches. With ``global-batch`` scope ``f_e`` counts
every micro-batch of the update *so far*, this one included, on every worker:

    micro-batch m of an update:  f_e = (sum_{j <= m} c_e^j) / (sum_{j <= m} n^j),   P_e = this micro-batch's

where ``c_e^j`` and ``n^j`` are micro-batch j's first-choice counts and real tokens, summed over the workers
(the layer's one all-reduce already sums them; nothing more is exchanged). Micro-batches run one after the
other, so micro-batch m cannot know the counts of those after it: only the last micro-batch's ``f`` is the
whole update's. That is Megatron-Core's ``global_aux_loss`` estimator (its running ``global_tokens_per_expert``)
and the paper's gradient-accumulation variant. What it promises, and the tests check:

* one micro-batch per update: exactly the micro-batch scope (W workers equal one process on the batches laid
  end to end, as today);
* N micro-batches on W workers equal one process running the same N micro-batches, each the workers' shares
  laid end to end (the counts of micro-batch j are the world's either way).

The counts live within one update: ``start_update(model)`` forgets them, and fairseq's ``Trainer.train_step``
calls it at the top of every update (hook 18; an ``--amp`` retry of the update starts again too), so a
skipped step (fp16 overflow) leaves nothing behind and nothing is ever saved in a checkpoint: a resumed run
counts exactly as an uninterrupted one. Used without fairseq, call ``start_update(model)`` before each
update's first micro-batch. Validation and inference use the micro-batch scope (their loss is only logged).
Activation checkpointing recomputes a layer's forward in backward: the recomputation reads the counts
without adding to them.
"""

from typing import Optional, Tuple

import torch
import torch.nn as nn


class UpdateLoad:
    """The first-choice counts ``[E]`` and real tokens of the update so far (totalled over the workers)."""

    def __init__(self):
        self.counts: Optional[torch.Tensor] = None
        self.tokens: Optional[torch.Tensor] = None

    def counted(
        self, counts: torch.Tensor, tokens: torch.Tensor, add: bool = True
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Add this micro-batch's ``counts`` and ``tokens`` (unless ``add`` is False: a recomputation), and
        return the update's totals so far."""
        if add:
            if self.counts is None:
                self.counts, self.tokens = counts.detach().clone(), tokens.detach().clone()
            else:
                self.counts, self.tokens = self.counts + counts.detach(), self.tokens + tokens.detach()
        if self.counts is None:  # a recomputation with nothing counted (cannot happen in one update)
            return counts, tokens
        return self.counts, self.tokens

    def reset(self) -> None:
        self.counts = self.tokens = None


def start_update(model: nn.Module) -> None:
    """Forget the counts of every global-batch MoE layer of ``model``: call it before an update's first
    micro-batch (fairseq's Trainer does, hook 18)."""
    for module in model.modules():
        load = getattr(module, "update_load", None)
        if isinstance(load, UpdateLoad):
            load.reset()
