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

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..moe.freeze import parse_frozen_parts
from ..moe.layer_config import ConflictingOptions, MoELayerConfig
from ..moe.placement import places_moe_layer
from ..options import (
    ARCH_OPTIONS,
    FLAG_OF_FIELD,
    MODEL_OPTIONS,
    TRANSLATION_OPTIONS,
    default,
    expert_count,
    expert_count_flag,
    option_value,
)
from ..options import moe_freq as options_moe_freq
from ..options.ranges import MODEL_RANGES, check_option, check_options

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


def moe_default(name: str):
    """The default of option ``name``: its record is the only place defaults are written."""
    return default(name)


def moe_option(args, name: str):
    """``args.<name>``, or the option's default where ``args`` lacks it."""
    return option_value(args, name)


def moe_freq(args, side: str) -> int:
    return options_moe_freq(args, side)


def layer_fields(args) -> Dict:
    """The ``MoELayerConfig`` fields the flags set, by their flat names (``MoELayerConfig.of``): each
    record's ``field``, its value converted by ``to_field`` or as the field holds it. ``hidden_dim`` is
    None where --moe-expert-ffn-dim is unset (the layer's ffn dim, which the caller knows)."""

    def read(name):
        return moe_option(args, name)

    fields = {}
    for o in MODEL_OPTIONS:
        if o.field is None:
            continue
        value = read(o.name)
        if o.to_field is not None:
            value = o.to_field(value, read)
        elif o.choices:
            value = str(value)
        elif o.type in (bool, float):
            value = o.type(value)
        fields[o.field.rsplit(".", 1)[-1]] = value
    return fields


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
    experts = moe_option(args, "moe_expert_count")
    check_option(MODEL_RANGES["moe_expert_count"], experts)
    check_options(MODEL_RANGES, lambda name: moe_option(args, name), experts=experts)
    check_routing_extensions(args)
    top_k = moe_option(args, "moe_top_k")
    for side in ("encoder", "decoder"):
        own = moe_option(args, f"{side}_moe_expert_count")
        if own is not None and isinstance(top_k, int) and top_k > own:
            raise MoEOptionError(
                f"--moe-top-k {top_k} exceeds --{side}-moe-expert-count {own}: use --moe-top-k <= {own}"
            )
    fields = layer_fields(args)
    layer_config(dict(fields, hidden_dim=fields["hidden_dim"] or 1), model_dim=1)
    frozen = parse_frozen_parts(moe_option(args, "moe_freeze"), "--moe-freeze")
    if "router" in frozen and str(moe_option(args, "moe_balance_scope")) == "global-batch":
        raise MoEOptionError(
            "--moe-balance-scope global-batch shapes the balance loss, which --moe-freeze router leaves out of the "
            "loss (the router cannot learn from it): drop --moe-balance-scope, or let the router train"
        )


def side_expert_counts(args, sides) -> Dict[str, int]:
    """The expert count of each of ``sides`` that has MoE layers (--{side}-moe-expert-count, else
    --moe-expert-count), for the expert-parallel size P, which must divide every one."""
    counts = {}
    for side in sides:
        if places_moe_layer(int(config_value(args, f"{side}_layers") or 0), moe_freq(args, side)):
            counts[side] = expert_count(args, side)
    return counts or {side: expert_count(args, side) for side in sides}


def side_expert_flags(args, sides) -> Dict[str, str]:
    """{side: the flag and value that set its expert count}, for messages."""
    return {side: expert_count_flag(args, side) for side in sides}


def check_routing_extensions(args) -> None:
    """Flags that do nothing without another one (the layer config has no field for them to conflict in)."""
    shared_dim = moe_option(args, "moe_shared_expert_ffn_dim")
    if shared_dim is not None and moe_option(args, "moe_shared_expert_count") == 0:
        raise MoEOptionError(
            f"--moe-shared-expert-ffn-dim {shared_dim} needs --moe-shared-expert-count >= 1: add shared experts or "
            f"drop the flag"
        )
    if moe_option(args, "moe_bias_update_rate") is not None and str(moe_option(args, "moe_balance")) != "bias":
        raise MoEOptionError("--moe-bias-update-rate has no effect without --moe-balance bias: add it or drop the rate")


def bias_update_rate(args) -> Optional[float]:
    """The rate of --moe-balance bias, or None without it (the layer's ``balance_bias_rate``)."""
    return layer_fields(args)["balance_bias_rate"]


def check_moe_layers_placed(args, sides) -> None:
    """An MoE architecture whose --moe-freq places no MoE layer would train a dense model under an
    MoE name; refuse it (a model without experts is what the dense architectures are for)."""
    layers = {side: int(config_value(args, f"{side}_layers") or 0) for side in sides}
    freqs = {side: moe_freq(args, side) for side in sides}
    if any(places_moe_layer(layers[side], freq) for side, freq in freqs.items()):
        return
    given = []
    for side in sides:
        own = moe_option(args, f"{side}_moe_freq") is not None
        flag = f"--{side}-moe-freq {freqs[side]}" if own else f"--moe-freq {freqs[side]}"
        if flag not in given:
            given.append(flag)
    counts = " and ".join(f"{layers[side]} {side} layers" for side in sides)
    most = max(layers.values())
    raise MoEOptionError(
        f"{' / '.join(given)} places no MoE layer in this model ({counts}; layer i is an MoE layer when (i + 1) is a "
        f"multiple of the frequency): use a frequency between 1 and {most}, or a dense --arch (transformer, "
        f"transformer_lm) for a model without experts"
    )
