"""The fairseq ``nllb`` branch's second-expert policies for top-2 routing (its ``top2gate.py``,
``--moe-second-expert-policy``), and its gate renormalisation after capacity dropping.

* ``all``: the second-best expert, always (what top-2 routing does anyway; NLLB-200 MoE's setting);
* ``sampling``: the argmax of ``logits + Gumbel(0, 1)`` noise over the experts other than the first, so
  the second expert is drawn with probability softmax over the others;
* ``random``: the second-best expert, kept with probability ``min(1, 2 * g2)``, where ``g2`` is its gate
  as it stands then (normalised over the two when the gates are normalised before dropping, the raw
  probability otherwise); a slot not kept is not routed and takes no capacity, like a dropped one.

The branch draws in evaluation too (its gate has no training switch there; Hugging Face's NllbMoe does the
same), and so do these: a model imported with ``sampling`` or ``random`` generates differently from run to
run unless the torch generator is seeded. The draws are those of the branch and of HF on the same tokens in
the same (batch-major) order: one ``torch.rand`` of ``[N, E]`` (``torch.distributions.Gumbel``) or of ``[N]``
per layer forward.
"""

import torch

from ..common.refusal import MoEOptionError

SECOND_EXPERT_POLICIES = ("all", "sampling", "random")


def check_second_expert_policy(policy: str) -> str:
    """``policy`` if it is one of ours; that it needs top-2 softmax routing is ``RoutingConfig``'s rule."""
    if policy not in SECOND_EXPERT_POLICIES:
        raise MoEOptionError(
            f"unknown second-expert policy {policy!r}: choose one of {', '.join(SECOND_EXPERT_POLICIES)}"
        )
    return policy


def sampled_second_expert(logits: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``[N]``: for each token the argmax over the experts other than ``first`` (``[N]``) of its logits plus
    Gumbel(0, 1) noise, which draws expert e with probability softmax(logits) over the others."""
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    noise = torch.distributions.Gumbel(zero, zero + 1).rsample(logits.shape)
    noisy = (logits.detach() + noise).scatter(1, first.unsqueeze(1), float("-inf"))
    return noisy.argmax(dim=1)


def randomly_kept_second(expert_index: torch.Tensor, gates: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``expert_index`` with each token's second choice replaced by the id ``num_experts`` (routed nowhere)
    unless a uniform draw is below ``2 * g2``."""
    second_gate = gates[:, 1].detach()
    kept = 2 * second_gate > torch.rand_like(second_gate)
    return torch.stack([expert_index[:, 0], torch.where(kept, expert_index[:, 1], num_experts)], dim=1)


def gates_renormalised_over_served(
    probs: torch.Tensor, expert_index: torch.Tensor, served: torch.Tensor
) -> torch.Tensor:
    """``[N, k]`` gates: each token's probabilities of the experts whose slots were served (``served``
    ``[N, k]``: not dropped by capacity, not skipped by the random policy, not padding), divided by their
    sum (at least eps): a token that kept one slot weights it 1, one that kept none weights nothing."""
    num_experts = probs.shape[1]
    chosen = probs.gather(1, expert_index.clamp(max=num_experts - 1)) * served.to(probs.dtype)
    total = chosen.sum(dim=1, keepdim=True).clamp(min=torch.finfo(chosen.dtype).eps)
    return chosen / total
