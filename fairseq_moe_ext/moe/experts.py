"""The experts: ``E_local`` feed-forward networks stored as stacked tensors.

Weights use ``nn.Linear``'s layout (``[out, in]``) stacked along dim 0, so expert ``i`` of a dense
FFN can be copied in verbatim and checkpoint tools can reshard experts by slicing dim 0.

Each expert is initialised from its own random generator seeded by ``(seed, global expert id)``:
experts never start identical (the symptom reported in Tutel issue #293,
https://github.com/microsoft/Tutel/issues/293), an expert's initial weights do not depend on how
many workers share the experts, and the global RNG, which initialises the router and every shared
weight, is left untouched so shared weights agree on every rank.
"""

import math
from typing import Callable, List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..common.refusal import MoEOptionError
from .expert_ffn import expert_ffn
from .grouped_mm import check_expert_matmul, default_expert_matmul, expert_groups, grouped_linear, select_expert_matmul


def is_expert(p) -> bool:
    """The marker MoELayer puts on expert parameters (``p.expert = True``): owned by one worker of
    an expert-parallel group, never broadcast or averaged like shared parameters."""
    return getattr(p, "expert", False) is True


def _gelu_accurate(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


# fmt: off
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_fast": _gelu_accurate,
    "gelu_accurate": _gelu_accurate,
    "tanh": torch.tanh,
    "linear": lambda x: x,
    "swish": F.silu,
    "silu": F.silu,
}
# fmt: on


def resolve_activation(activation: Union[str, Callable]) -> Callable:
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise MoEOptionError(
            f"unknown activation {activation!r}: choose one of {', '.join(ACTIVATIONS)} or pass a callable"
        )
    return ACTIVATIONS[activation]


def expert_seed(seed: int, global_expert_id: int) -> int:
    """A seed for one expert: distinct per (seed, id), reproducible, independent of world size."""
    return (int(seed) * 1_000_003 + int(global_expert_id) * 7919 + 12345) % (2**63 - 1)


class BatchedExperts(nn.Module):
    def __init__(
        self,
        model_dim: int,
        hidden_dim: int,
        num_local_experts: int,
        first_global_id: int = 0,
        activation: Union[str, Callable] = "relu",
        activation_dropout: float = 0.0,
        bias: bool = True,
        seed: int = 0,
        matmul: Optional[str] = None,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        """``device="meta"``: built to be loaded (allocates nothing, initialises nothing); the checkpoint's
        tensors become the parameters in ``dtype`` when the state is loaded (``_load_from_state_dict``)."""
        # The sizes and the dropout were checked where they were configured (MoELayerConfig).
        super().__init__()
        self.model_dim = model_dim
        self.hidden_dim = hidden_dim
        self.num_local_experts = num_local_experts
        self.first_global_id = first_global_id
        self.activation = resolve_activation(activation)
        self.activation_dropout = activation_dropout
        self.seed = seed
        # Which kernels run the expert matmuls (see grouped_mm.py); None: $FAIRSEQ_MOE_EXPERT_MATMUL or auto.
        self.matmul = check_expert_matmul(matmul) if matmul is not None else default_expert_matmul()
        where = dict(device=device, dtype=dtype)
        self.batched_fc1_w = nn.Parameter(torch.empty(num_local_experts, hidden_dim, model_dim, **where))
        self.batched_fc2_w = nn.Parameter(torch.empty(num_local_experts, model_dim, hidden_dim, **where))
        if bias:
            self.batched_fc1_b = nn.Parameter(torch.empty(num_local_experts, hidden_dim, **where))
            self.batched_fc2_b = nn.Parameter(torch.empty(num_local_experts, model_dim, **where))
        else:
            self.register_parameter("batched_fc1_b", None)
            self.register_parameter("batched_fc2_b", None)
        if not self.batched_fc1_w.is_meta:
            self.reset_parameters()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args, **kwargs):
        """Experts built on ``meta`` take the checkpoint's tensors as their parameters, cast to the dtype they
        were built in (a tensor already in it is kept as loaded, a memory-mapped file's pages included): no
        second copy, and no fp32 copy of experts that run in fp16/bf16. Built ones copy as torch does."""
        built = dict(self.named_parameters(recurse=False))
        if not any(p.is_meta for p in built.values()):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args, **kwargs)
        for name, param in built.items():
            key = prefix + name
            if key in state_dict and torch.is_tensor(state_dict[key]) and state_dict[key].shape == param.shape:
                state_dict[key] = state_dict[key].to(dtype=param.dtype)  # the shape is checked by torch below
        assigning = dict(local_metadata, assign_to_params_buffers=True)
        super()._load_from_state_dict(state_dict, prefix, assigning, strict, *args, **kwargs)
        for name, param in self.named_parameters(recurse=False):
            param.expert = getattr(built[name], "expert", False)  # the marker travels with the parameter

    @torch.no_grad()
    def reset_parameters(self):
        # nn.Linear's default (kaiming-uniform with a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        for i in range(self.num_local_experts):
            g = torch.Generator().manual_seed(expert_seed(self.seed, self.first_global_id + i))
            for weight, bias_param, fan_in in (
                (self.batched_fc1_w, self.batched_fc1_b, self.model_dim),
                (self.batched_fc2_w, self.batched_fc2_b, self.hidden_dim),
            ):
                bound = 1.0 / math.sqrt(fan_in)
                w = torch.rand(weight.shape[1:], generator=g, dtype=torch.float32) * (2 * bound) - bound
                weight[i].copy_(w)
                b = torch.rand(weight.shape[1], generator=g, dtype=torch.float32) * (2 * bound) - bound
                if bias_param is not None:
                    bias_param[i].copy_(b)

    def forward(self, x: torch.Tensor, counts: List[int], device_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` holds tokens sorted by local expert; ``counts[i]`` rows belong to expert ``i``.
        ``device_counts``: the same counts as an int tensor on ``x``'s device, if the caller has
        them (the grouped kernel takes its offsets from them instead of copying ``counts`` over)."""
        if len(counts) != self.num_local_experts:
            raise ValueError(f"expected {self.num_local_experts} token counts, got {len(counts)}")
        dropout_p = self.activation_dropout if self.training else 0.0
        w1, b1, w2, b2 = self.batched_fc1_w, self.batched_fc1_b, self.batched_fc2_w, self.batched_fc2_b
        if x.dtype != w1.dtype and x.is_floating_point() and not torch.is_autocast_enabled(x.device.type):
            # fp32 weights, low-precision activations (--ddp-backend fully_sharded with --bf16/--fp16:
            # the weights are the fp32 masters): compute in the activations' dtype; the casts are
            # part of the graph, so the gradients reach the fp32 weights in fp32.
            w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
            b1, b2 = (None if b is None else b.to(x.dtype) for b in (b1, b2))
        if select_expert_matmul(self.matmul, x, w1) == "grouped_mm":
            groups = expert_groups(counts, x.device, device_counts)
            h = self.activation(grouped_linear(x, groups, w1, b1))
            h = F.dropout(h, p=dropout_p, training=dropout_p > 0)
            return grouped_linear(h, groups, w2, b2)
        # Every expert runs, also on zero rows, so every expert weight receives a gradient (zero
        # when unused), exactly as in a single process holding all experts.
        return expert_ffn(x, counts, w1, b1, w2, b2, self.activation, dropout_p)

    def extra_repr(self):
        return (
            f"experts={self.num_local_experts} (global ids {self.first_global_id}.."
            f"{self.first_global_id + self.num_local_experts - 1}), model_dim={self.model_dim}, "
            f"hidden_dim={self.hidden_dim}, activation_dropout={self.activation_dropout}"
        )
