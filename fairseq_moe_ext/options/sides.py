"""A model's encoder and decoder as one type: ``Side``, built once per model from its config.

Each stack of layers that may hold MoE layers is a side: its name ("encoder", "decoder"; a language model
has the decoder only), how many layers it has, its MoE frequency (``--{side}-moe-freq``, else
``--moe-freq``), its expert count (``--{side}-moe-expert-count``, else ``--moe-expert-count``) and the flag
that set each, as a message names it. The models, the expert-parallel size, upcycling, pruning and ``plan``
read these fields instead of building the flag names from strings (fairseq's ``EncDecBaseConfig`` is the
same idea for its own per-side options).
"""

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from ..common.config_value import config_value
from ..moe.placement import moe_layer_indices, places_moe_layer
from . import expert_count, moe_freq, option_value

SIDE_NAMES = ("encoder", "decoder")


@dataclass(frozen=True)
class Side:
    name: str  # "encoder" or "decoder": the model's attribute holding the stack
    layers: int  # --{side}-layers
    moe_freq: int  # every moe_freq-th layer is an MoE layer (0: none)
    freq_option: str  # the flag that set it: "--decoder-moe-freq" (its own) or "--moe-freq" (the shared one)
    experts: int  # experts in each of its MoE layers
    experts_option: str  # the flag that set it: "--encoder-moe-expert-count" or "--moe-expert-count"

    @property
    def freq_flag(self) -> str:
        """The flag and value that set its MoE frequency, as a message names them: ``--moe-freq 2``."""
        return f"{self.freq_option} {self.moe_freq}"

    @property
    def experts_flag(self) -> str:
        """The flag and value that set its expert count: ``--encoder-moe-expert-count 4``."""
        return f"{self.experts_option} {self.experts}"

    @property
    def own_experts(self) -> bool:
        """Was its expert count given for it alone (``--{side}-moe-expert-count``)?"""
        return self.experts_option != "--moe-expert-count"

    @property
    def moe_layers(self) -> List[int]:
        """The indices of its MoE layers."""
        return moe_layer_indices(self.layers, self.moe_freq)

    @property
    def has_moe_layers(self) -> bool:
        return places_moe_layer(self.layers, self.moe_freq)


def side_of(cfg, name: str) -> Side:
    """Side ``name`` of the model ``cfg`` describes (any config: Namespace, omegaconf, dict)."""
    own_freq = option_value(cfg, f"{name}_moe_freq") is not None
    own_experts = option_value(cfg, f"{name}_moe_expert_count") is not None
    return Side(
        name=name,
        layers=int(config_value(cfg, f"{name}_layers") or 0),
        moe_freq=moe_freq(cfg, name),
        freq_option=f"--{name}-moe-freq" if own_freq else "--moe-freq",
        experts=expert_count(cfg, name),
        experts_option=f"--{name}-moe-expert-count" if own_experts else "--moe-expert-count",
    )


def sides_of(cfg, names: Sequence[str] = SIDE_NAMES) -> Tuple[Side, ...]:
    """The sides ``names`` of the model ``cfg`` describes, in that order."""
    return tuple(side_of(cfg, name) for name in names)


def expert_sides(sides: Sequence[Side]) -> Tuple[Side, ...]:
    """The sides holding MoE layers (all of them where none does: a model refused later, named by its flags)."""
    holding = tuple(side for side in sides if side.has_moe_layers)
    return holding or tuple(sides)
