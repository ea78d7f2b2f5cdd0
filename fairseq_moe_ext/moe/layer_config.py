"""What an MoE layer is, as one frozen value: every option of ``MoELayer`` with its default, and its
validation written once (``__post_init__``), so a layer, a checkpoint check or a test never repeats it.

The routing options are nested in ``RoutingConfig`` (what ``TopKRouter`` reads); the rest describes
the experts and capacity. What is not an option of the layer's function stays a constructor argument
of ``MoELayer``: the process groups, the aux cache, the layer's name and its seed.

Messages are the layer's own (``num_experts must be a positive integer``); the fairseq flags are
checked, with their flag names, before a config is built (``options/ranges.py``). The rules between
options (k <= E, the sigmoid router needs k >= 2, the second-expert policy needs top-2 softmax,
normalising after dropping needs the top router) are written here only: each raises
``ConflictingOptions``, which names the fields (``k=5 exceeds num_experts=4``) and can name them as a
caller's options instead (``models/moe_layers.py``: ``--moe-top-k 5 exceeds --moe-expert-count 4``).
"""

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Dict, Optional, Union

from ..common.refusal import MoEOptionError
from .balance_bias import check_bias_update_rate
from .capacity import check_capacity_factor
from .experts import resolve_activation
from .scorers import SCORERS
from .second_expert import check_second_expert_policy
from .shared_experts import check_shared_experts

ROUTER_TYPES = tuple(SCORERS)  # the registry's names; scorers.py says what each one computes
# Whose first choices the balance loss's load fractions count (layer.py, balance_scope.py).
BALANCE_SCOPES = ("micro-batch", "global-batch")


class Named:
    """One option in a ``ConflictingOptions`` message: ``{k}`` is its name with its value, ``{k.name}`` and
    ``{k.value}`` each alone."""

    def __init__(self, name: str, value, pair: str):
        self.name, self.value, self._pair = name, value, pair

    def __format__(self, spec) -> str:
        return self._pair.format(self.name, self.value)


class ConflictingOptions(MoEOptionError):
    """Options that do not go together. ``template`` names each option by its field's flat name (``{k}``),
    ``given`` holds their values, ``wanted`` the values the fix asks for (``{top}``: ``router_type`` top).
    ``str()`` names them as fields (``k=5``); ``worded(names)`` as a caller's options are named."""

    def __init__(self, template: str, given: Dict, wanted: Optional[Dict] = None):
        self.template, self.given, self.wanted = template, given, wanted or {}
        super().__init__(self.worded({}, "{}={}"))

    def __reduce__(self):  # pickled (e.g. from a worker process) with what it was made of, not its message
        return type(self), (self.template, self.given, self.wanted)

    def worded(self, names: Dict[str, str], pair: str = "{} {}") -> str:
        """The message with field ``f`` named ``names.get(f, f)``, a name and its value written ``pair``."""
        values = {key: Named(names.get(key, key), value, pair) for key, value in self.given.items()}
        for key, (field_name, value) in self.wanted.items():
            values[key] = Named(names.get(field_name, field_name), value, pair)
        return self.template.format(**values)


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
        if self.router_type not in SCORERS:
            raise MoEOptionError(f"unknown router type {self.router_type!r}: choose one of {', '.join(SCORERS)}")
        noise = self.gate_noise
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise < 0:
            raise MoEOptionError(f"gate_noise must be a finite number >= 0, got {noise!r}")
        if SCORERS[self.router_type].gates_normalised_over_chosen and k < 2:
            raise ConflictingOptions(
                "{router_type} normalises the gates over the chosen experts, so with {k} every gate is 1 and the "
                "router never learns: use {k.name} 2 or more, or {top}",
                dict(router_type=self.router_type, k=k), dict(top=("router_type", "top")))
        if self.balance_bias_rate is not None:
            object.__setattr__(self, "balance_bias_rate", check_bias_update_rate(self.balance_bias_rate))
        policy = check_second_expert_policy(self.second_expert_policy)
        if policy != "all" and (k != 2 or self.router_type != "top"):
            raise ConflictingOptions(
                "{second_expert_policy} is defined for the nllb branch's top-2 softmax routing: use {two} with "
                "{top}, or drop {second_expert_policy.name}",
                dict(second_expert_policy=policy), dict(two=("k", 2), top=("router_type", "top")))
        if self.normalize_gates_after_dropping and self.router_type != "top":
            raise ConflictingOptions(
                "{normalize_gates_after_dropping.name} renormalises softmax probabilities: use it with {top}, or "
                "drop it", dict(normalize_gates_after_dropping=True), dict(top=("router_type", "top")))
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
    expert_output_masking: float = 0.0  # expert_output_masking.py
    # The nllb branch's evaluation capacity, ceil(f * S) slots per expert with S every token position
    # (capacity.token_fraction_capacity); replaces eval_capacity_factor when > 0.
    eval_capacity_token_fraction: float = 0.0
    # The balance loss's load fractions: this micro-batch's tokens, or every micro-batch's of the update so
    # far (balance_scope.py); either way over the statistics group's workers.
    balance_scope: str = "micro-batch"

    def __post_init__(self):
        _positive_int("model_dim", self.model_dim)
        _positive_int("hidden_dim", self.hidden_dim)
        _positive_int("num_experts", self.num_experts)
        if not isinstance(self.routing, RoutingConfig):
            raise MoEOptionError(f"routing must be a RoutingConfig, got {self.routing!r}")
        k = self.routing.k
        if k > self.num_experts:
            given = dict(k=k, num_experts=self.num_experts)
            raise ConflictingOptions("{k} exceeds {num_experts}: use {k.name} <= {num_experts.value}", given)
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
        if self.balance_scope not in BALANCE_SCOPES:
            choices = ", ".join(BALANCE_SCOPES)
            raise MoEOptionError(f"unknown balance scope {self.balance_scope!r}: choose one of {choices}")

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
