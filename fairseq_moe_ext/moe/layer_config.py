"""What an MoE layer is, as one frozen value: every option of ``MoELayer`` with its default, and its
validation written once (``__post_init__``), so a layer, a checkpoint check or a test never repeats it.

The routing options are nested in ``RoutingConfig`` (what ``TopKRouter`` reads); the rest describes
the experts and capacity. What is not an option of the layer's function stays a constructor argument
of ``MoELayer``: the process groups, the aux cache, the layer's name and its seed.

Messages are the layer's own (``num_experts must be a positive integer``); the fairseq flags are
checked, with their flag names, before a config is built (``option_ranges.py``).
"""

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Union

from .balance_bias import check_bias_update_rate
from .capacity import check_capacity_factor
from .experts import resolve_activation
from .second_expert import check_second_expert_policy
from .shared_experts import check_shared_experts
from .refusal import MoEOptionError

ROUTER_TYPES = ("top", "cosine", "sigmoid")  # router.py says what each one computes


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MoEOptionError(f"{name} must be a positive integer, got {value!r}")


# fmt: off
@dataclass(frozen=True)
class RoutingConfig:
    """How tokens choose their experts (``router.py``)."""

    k: int = 2
    router_type: str = "top"
    fp32: bool = True  # route in fp32 whatever the activation dtype
    gate_noise: float = 0.0  # std (divided by E) of the noise on the logits that choose, training only
    normalize_gates: bool = False  # a token's k gates sum to 1
    batch_prioritized: bool = False  # over capacity, serve the highest top-1 gate first
    balance_bias_rate: Optional[float] = None  # loss-free balancing (balance_bias.py); None: off
    # The nllb branch's top-2 gate (second_expert.py): how the second expert is chosen, and whether the
    # gates are renormalised over the slots kept after capacity dropping (by the layer) instead of before.
    second_expert_policy: str = "all"
    normalize_gates_after_dropping: bool = False

    def __post_init__(self):
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise MoEOptionError(f"top-k must be an integer >= 1, got {k!r}")
        if self.router_type not in ROUTER_TYPES:
            raise MoEOptionError(f"unknown router type {self.router_type!r}: choose one of {', '.join(ROUTER_TYPES)}")
        noise = self.gate_noise
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise < 0:
            raise MoEOptionError(f"gate_noise must be a finite number >= 0, got {noise!r}")
        if self.router_type == "sigmoid" and k < 2:
            raise MoEOptionError(
                "the sigmoid router normalises gates over the chosen k experts, so with k=1 every gate is 1 and "
                "the router never learns: use k >= 2, or the 'top' router for k=1"
            )
        if self.balance_bias_rate is not None:
            object.__setattr__(self, "balance_bias_rate", check_bias_update_rate(self.balance_bias_rate))
        check_second_expert_policy(self.second_expert_policy, k, self.router_type)
        if self.normalize_gates_after_dropping and self.router_type != "top":
            raise MoEOptionError("normalize_gates_after_dropping renormalises softmax probabilities: use it with the "
                             "'top' router")
# fmt: on


# fmt: off
@dataclass(frozen=True)
class MoELayerConfig:
    """One MoE layer's options; ``MoELayer(config, group=..., statistics_group=..., cache=..., name=..., seed=...)``."""

    model_dim: int
    hidden_dim: int  # each routed expert's
    num_experts: int  # over every worker of the expert-parallel group
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # Tutel semantics (capacity.py): > 0 fixed, 0 dropless, < 0 dropless up to a bound.
    capacity_factor: float = 0.0
    eval_capacity_factor: float = 0.0
    activation: Union[str, Callable] = "relu"
    activation_dropout: float = 0.0
    bias: bool = True
    shared_expert_count: int = 0  # shared_experts.py
    shared_expert_dim: Optional[int] = None  # None: hidden_dim
    expert_output_masking: float = 0.0  # the layer's _mask_expert_outputs
    # The nllb branch's evaluation capacity, ceil(f * S) slots per expert with S every token position
    # (capacity.token_fraction_capacity); replaces eval_capacity_factor when > 0.
    eval_capacity_token_fraction: float = 0.0

    def __post_init__(self):
        _positive_int("model_dim", self.model_dim)
        _positive_int("hidden_dim", self.hidden_dim)
        _positive_int("num_experts", self.num_experts)
        if not isinstance(self.routing, RoutingConfig):
            raise ValueError(f"routing must be a RoutingConfig, got {self.routing!r}")
        k = self.routing.k
        if k > self.num_experts:
            raise MoEOptionError(
                f"top-k ({k}) exceeds the number of experts ({self.num_experts}): "
                f"use k <= {self.num_experts} or add experts"
            )
        # Floats from here on, so a config built from an int compares and prints like one from a flag.
        object.__setattr__(self, "capacity_factor", check_capacity_factor(self.capacity_factor))
        object.__setattr__(
            self, "eval_capacity_factor", check_capacity_factor(self.eval_capacity_factor, "eval_capacity_factor")
        )
        resolve_activation(self.activation)
        if not 0.0 <= self.activation_dropout < 1.0:
            raise MoEOptionError(f"activation_dropout must be in [0, 1), got {self.activation_dropout!r}")
        check_shared_experts(self.shared_expert_count, self.shared_hidden_dim)
        if not 0.0 <= float(self.expert_output_masking) < 1.0:
            raise MoEOptionError(f"expert_output_masking must be in [0, 1), got {self.expert_output_masking!r}")
        object.__setattr__(self, "expert_output_masking", float(self.expert_output_masking))
        fraction = self.eval_capacity_token_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < math.inf:
            raise MoEOptionError(f"eval_capacity_token_fraction must be a finite number >= 0, got {fraction!r}")
        object.__setattr__(self, "eval_capacity_token_fraction", float(fraction))

    @property
    def shared_hidden_dim(self) -> int:
        return self.hidden_dim if self.shared_expert_dim is None else self.shared_expert_dim

    @classmethod
    def of(cls, model_dim: int, hidden_dim: int, num_experts: int, **options) -> "MoELayerConfig":
        """The config from flat keywords (``k=2, capacity_factor=1.25, router_type="sigmoid"``): each goes to
        ``RoutingConfig`` or to the layer's fields by its name, so a call site need not know which holds it."""
        routing = {name: options.pop(name) for name in _ROUTING_FIELDS if name in options}
        unknown = sorted(set(options) - _LAYER_FIELDS)
        if unknown:
            raise TypeError(f"unknown MoE layer option {unknown[0]!r}: the options are the fields of MoELayerConfig "
                            f"and RoutingConfig (moe/layer_config.py)")
        return cls(model_dim, hidden_dim, num_experts, routing=RoutingConfig(**routing), **options)
# fmt: on


_ROUTING_FIELDS = tuple(f.name for f in fields(RoutingConfig))
_LAYER_FIELDS = {f.name for f in fields(MoELayerConfig)} - {"model_dim", "hidden_dim", "num_experts", "routing"}
