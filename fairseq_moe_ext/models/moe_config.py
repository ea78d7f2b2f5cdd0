"""The ``--moe-*`` model options as fairseq dataclasses, and their translation into an MoE layer's config.

Each option is declared once, as a record (``options/``): its type, default and help make the fields of
``MoEConfig`` (every architecture) and ``MoEEncoderDecoderConfig`` (the translation ones), its ``field``
the ``MoELayerConfig`` field it sets (``layer_fields``). Names follow fairseq's ``moe`` branch where it had
them.
"""

import logging
from dataclasses import field, make_dataclass
from typing import Dict, Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..common.refusal import MoEOptionError
from ..moe.layer_config import ConflictingOptions, MoELayerConfig
from ..options import (
    ARCH_OPTIONS,
    FLAG_OF_FIELD,
    MODEL_OPTIONS,
    TRANSLATION_OPTIONS,
    layer_fields,
    moe_options,
)
from ..options.ranges import MODEL_RANGES, check_option, check_options
from ..options.sides import sides_of

logger = logging.getLogger(__name__)


def dataclass_of(name: str, records, base, module: str = __name__):
    """A fairseq dataclass with one field per record, in their order: its type (a ChoiceEnum for a
    choice), default and help. Named as a class written in ``module``, so pickles find it there."""
    fields = []
    for o in records:
        kind = ChoiceEnum(list(o.choices)) if o.choices else o.type
        fields.append((o.name, kind, field(default=o.default, metadata={"help": o.help})))
    made = make_dataclass(name, fields, bases=(base,))
    made.__module__ = module
    return made


MoEConfig = dataclass_of("MoEConfig", ARCH_OPTIONS, FairseqDataclass)
MoEEncoderDecoderConfig = dataclass_of("MoEEncoderDecoderConfig", TRANSLATION_OPTIONS, MoEConfig)

# Every --moe-* option of either architecture (the translation config is the larger one).
MOE_OPTIONS = tuple(o.name for o in MODEL_OPTIONS)


def layer_config(fields: Dict, **rest) -> MoELayerConfig:
    """``MoELayerConfig.of(**fields, **rest)``; options that do not go together are named by their flags."""
    try:
        return MoELayerConfig.of(**fields, **rest)
    except ConflictingOptions as e:
        raise MoEOptionError(e.worded(FLAG_OF_FIELD)) from None


def check_moe_args(args) -> None:
    """Fail before anything is built, with one line that names the flag and the fix: every numeric
    option against the range of what it is used in (``options.ranges.MODEL_RANGES``), then the
    options against each other (the layer config's rules, in flag words)."""
    values = moe_options(args)
    experts = values.moe_expert_count
    check_option(MODEL_RANGES["moe_expert_count"], experts)
    check_options(MODEL_RANGES, lambda name: getattr(values, name), experts=experts)
    check_routing_extensions(args)
    top_k = values.moe_top_k
    for side in sides_of(args):
        if side.own_experts and isinstance(top_k, int) and top_k > side.experts:
            raise MoEOptionError(f"--moe-top-k {top_k} exceeds {side.experts_flag}: use --moe-top-k <= {side.experts}")
    fields = layer_fields(args)
    layer_config(dict(fields, hidden_dim=fields["hidden_dim"] or 1), model_dim=1)
    if "router" in values.moe_freeze and values.moe_balance_scope == "global-batch":
        raise MoEOptionError(
            "--moe-balance-scope global-batch shapes the balance loss, which --moe-freeze router leaves out of the "
            "loss (the router cannot learn from it): drop --moe-balance-scope, or let the router train"
        )


def check_routing_extensions(args) -> None:
    """Flags that do nothing without another one (the layer config has no field for them to conflict in)."""
    values = moe_options(args)
    shared_dim = values.moe_shared_expert_ffn_dim
    if shared_dim is not None and values.moe_shared_expert_count == 0:
        raise MoEOptionError(
            f"--moe-shared-expert-ffn-dim {shared_dim} needs --moe-shared-expert-count >= 1: add shared experts or "
            f"drop the flag"
        )
    if values.moe_bias_update_rate is not None and values.moe_balance != "bias":
        raise MoEOptionError("--moe-bias-update-rate has no effect without --moe-balance bias: add it or drop the rate")


def bias_update_rate(args) -> Optional[float]:
    """The rate of --moe-balance bias, or None without it (the layer's ``balance_bias_rate``)."""
    return layer_fields(args)["balance_bias_rate"]


def check_moe_layers_placed(args, names) -> None:
    """An MoE architecture whose --moe-freq places no MoE layer would train a dense model under an
    MoE name; refuse it (a model without experts is what the dense architectures are for)."""
    sides = sides_of(args, names)
    if any(side.has_moe_layers for side in sides):
        return
    given = " / ".join(dict.fromkeys(side.freq_flag for side in sides))
    counts = " and ".join(f"{side.layers} {side.name} layers" for side in sides)
    most = max(side.layers for side in sides)
    raise MoEOptionError(
        f"{given} places no MoE layer in this model ({counts}; layer i is an MoE layer when (i + 1) is a "
        f"multiple of the frequency): use a frequency between 1 and {most}, or a dense --arch (transformer, "
        f"transformer_lm) for a model without experts"
    )
