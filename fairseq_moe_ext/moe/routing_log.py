"""The routing statistics an MoE layer records with its losses (``MoEAux.stats``) for the logs: this worker's
counts, kept on the device (the criterion reads every layer's at once, criterions/moe_criterions.py)."""

from typing import Dict

import torch


def routing_log(
    local_tokens: torch.Tensor, k: int, served_load: torch.Tensor, routed_load: torch.Tensor, probs: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """``local_tokens`` ``[1]``: real tokens; ``served_load`` / ``routed_load`` ``[E]``: slots per expert after /
    before capacity; ``probs`` ``[N, E]``: the router's probabilities, zero at pad tokens."""
    probs = probs.detach()
    num_slots = local_tokens.squeeze(0) * k
    return {
        "num_tokens": local_tokens.squeeze(0).float(),
        "num_slots": num_slots.float(),
        "dropped_slots": (num_slots - served_load.sum()).float(),
        "expert_slots": routed_load.float(),
        # In fp32 whatever the router's dtype: pads' (and underflowed) probabilities are 0, and
        # 0 * log(0) must count 0 (xlogy), not NaN as with fp16's clamp_min(1e-20) == 0.
        "router_entropy_sum": -torch.special.xlogy(probs.float(), probs.float()).sum(),
    }
