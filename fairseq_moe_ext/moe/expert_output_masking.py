"""Expert Output Masking (NLLB-200's ``--moe-eom``), applied to the dispatched rows of the experts' output."""

import torch


def mask_expert_outputs(expert_out: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """With rate ``p``: in training each served slot's expert output (one token's output from one of its
    experts, the whole vector) is zeroed with probability p, without rescaling the others; in evaluation
    every expert output is multiplied by 1 - p, its expectation. As the nllb branch's MoE layer does it (per
    dispatched slot, before the gates weight it); Hugging Face's NllbMoe trains with element-wise dropout
    instead (same evaluation)."""
    if p == 0.0:
        return expert_out
    if not training:
        return expert_out * (1.0 - p)
    keep = torch.rand(expert_out.shape[0], device=expert_out.device) >= p
    return expert_out * keep.unsqueeze(1).to(expert_out.dtype)
