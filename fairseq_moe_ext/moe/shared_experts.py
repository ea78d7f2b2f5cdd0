"""Shared experts (DeepSeek-MoE; Dai et al. 2024): S experts every token always uses, beside the
k routed ones; the MoE layer adds their output to the routed experts' combined output.

S feed-forward networks of hidden size h applied to the same token and summed are one network of
hidden size S*h (fc1's rows and fc2's columns concatenated, fc2's biases added), so they run as one
dense FFN of width S*h through the experts' own kernel. Its parameters are *shared* parameters (no
``expert`` marker): replicated on every worker, gradients averaged, stored once in a checkpoint
set, initialised from a seed that does not depend on the worker.
"""

from typing import Callable, Union

import torch
import torch.nn as nn

from ..common.refusal import MoEOptionError
from .experts import BatchedExperts


def check_shared_experts(count, hidden_dim) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise MoEOptionError(f"the shared expert count must be an integer >= 0, got {count!r}: use 0 for none")
    if count > 0 and (isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1):
        raise MoEOptionError(f"the shared experts' hidden size must be a positive integer, got {hidden_dim!r}")


class SharedExperts(nn.Module):
    def __init__(
        self,
        model_dim: int,
        hidden_dim: int,
        count: int,
        activation: Union[str, Callable] = "relu",
        activation_dropout: float = 0.0,
        bias: bool = True,
        seed: int = 0,
    ):
        super().__init__()  # count and hidden_dim were checked where they were configured (MoELayerConfig)
        self.count = count
        self.hidden_dim = hidden_dim
        # One "expert" of width S*h; its id (-1) is one no routed expert has, so its weights are not
        # a copy of any routed expert's.
        self.ffn = BatchedExperts(
            model_dim,
            count * hidden_dim,
            1,
            first_global_id=-1,
            activation=activation,
            activation_dropout=activation_dropout,
            bias=bias,
            seed=seed,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., model_dim]``; every token, pad tokens included (as fairseq's dense FFN)."""
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        # The row count also on the device, made there (a fill, not a host-to-device copy): the
        # grouped kernel's offsets would otherwise cost a second host sync per layer forward.
        on_device = torch.full((1,), rows, dtype=torch.int64, device=flat.device)
        return self.ffn(flat, [rows], on_device).view_as(x)

    def extra_repr(self):
        return f"shared_experts={self.count}, hidden_dim={self.hidden_dim} each"
