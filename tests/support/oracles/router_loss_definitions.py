"""The router losses as the papers define them, and their gradients w.r.t. the router logits in
closed form (no project loss code): the oracle of tests/core/test_moe_objective_oracle.py (which
gradchecks the closed forms) and tests/fairseq/test_moe_criterion_weights.py.

* Balance loss (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): ``E * sum_e f_e * P_e``,
  ``f_e`` the fraction of real tokens whose top-1 choice is ``e`` (top-1 only, also for k=2) and
  ``P_e`` the mean router probability of ``e`` over real tokens.
* Router z-loss (ST-MoE, Zoph et al. 2022): ``mean over real tokens of logsumexp(logits)^2``.
"""

import torch

E = 4  # experts: the definitions count top-1 choices over this many


def log_sum_exp(logits):
    top = logits.max(-1, keepdim=True).values
    return (top + (logits - top).exp().sum(-1, keepdim=True).log()).squeeze(-1)


def router_probabilities(logits):
    return (logits - log_sum_exp(logits).unsqueeze(-1)).exp()


def top1_fractions(top1, num_tokens):
    return torch.tensor([float((top1 == e).sum()) / num_tokens for e in range(E)], dtype=torch.float64)


def switch_balance_loss(logits, top1):
    f = top1_fractions(top1, logits.shape[0]).to(logits.dtype)
    mean_probability = router_probabilities(logits).sum(0) / logits.shape[0]
    return E * (f * mean_probability).sum()


def switch_balance_loss_grad(logits, top1):
    """d/dl_nj of E/N sum_e f_e p_ne = E/N * p_nj * (f_j - sum_e f_e p_ne); f is piecewise constant."""
    n = logits.shape[0]
    p = router_probabilities(logits)
    f = top1_fractions(top1, n).to(logits.dtype)
    return E / n * p * (f - (p * f).sum(-1, keepdim=True))


def st_moe_z_loss(logits):
    return log_sum_exp(logits).pow(2).sum() / logits.shape[0]


def st_moe_z_loss_grad(logits):
    """d/dl_nj of 1/N sum_n lse_n^2 = 2/N * lse_n * p_nj."""
    return 2.0 / logits.shape[0] * log_sum_exp(logits).unsqueeze(-1) * router_probabilities(logits)
