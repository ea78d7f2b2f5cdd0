"""Auxiliary router losses, computed from sums so that they can be totalled over workers first.

* Balance loss (GShard / Switch): ``E * sum_e mean_prob_e * frac_e`` where ``mean_prob_e`` is the
  mean router probability of expert ``e`` and ``frac_e`` the fraction of tokens whose first choice
  is ``e``. It is 1.0 when routing is perfectly balanced and ``E`` when every token picks one expert.
* Router z-loss (ST-MoE): ``mean_n logsumexp(logits_n)^2``; keeps logits small so the fp32 softmax
  stays well conditioned.
"""

import torch


def balance_loss(
    prob_sum: torch.Tensor, top1_count: torch.Tensor, num_tokens: torch.Tensor, count_tokens=None
) -> torch.Tensor:
    """``prob_sum[e] = sum_n p[n, e]`` over ``num_tokens`` tokens, ``top1_count[e]`` = tokens whose first choice
    is ``e`` among ``count_tokens`` (default the same tokens; the global-batch scope counts more:
    balance_scope.py)."""
    num_experts = prob_sum.shape[-1]
    n = num_tokens.clamp_min(1).to(prob_sum.dtype)
    counted = n if count_tokens is None else count_tokens.clamp_min(1).to(prob_sum.dtype)
    return num_experts * torch.sum((prob_sum / n) * (top1_count.to(prob_sum.dtype) / counted))


def z_loss(lse_square_sum: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    return lse_square_sum / num_tokens.clamp_min(1).to(lse_square_sum.dtype)
