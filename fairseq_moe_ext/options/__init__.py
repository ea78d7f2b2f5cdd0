"""Every ``--moe-*`` option of the plugin, declared once: one ``Option`` record per option.

The tables that used to spell each option out are derived from the records, where they are used:

* the fairseq dataclasses ``MoEConfig`` / ``MoEEncoderDecoderConfig`` (``models/moe_config.py``) and
  ``MoELossConfig`` (``criterions/moe_criterions.py``), hence argparse and docs/options.md;
* ``options.ranges.MODEL_RANGES`` / ``CRITERION_RANGES`` (each record's ``range``);
* ``training/resume_policy.POLICY`` (``resume``, ``why``, ``effective``);
* the flags-to-layer-config translation ``models/moe_layers.moe_layer_config`` (``field``, ``to_field``),
  which also names a conflict ``MoELayerConfig`` finds by its flags (``FLAG_OF_FIELD``);
* the value of an option in any config, its default where the config lacks it (``option_value``,
  ``moe_freq``), read by ``models/`` and, with no callback into them, by ``checkpoint/``;
* the Hugging Face and nllb-branch names (``HF_NAMES``, ``BRANCH_NAMES``: ``checkpoint/hf/config.py``,
  ``checkpoint/branch/options.py``).

Torch only and fairseq-free (tier 1 in tests/repo/test_package_tiers.py: above ``moe/``, whose
constants the records name, below ``checkpoint/``). A new option is one record in ``model.py``,
``run.py``, ``criterion.py`` or ``inference.py`` (the inference CLIs' flags, which the plugin adds to
their parsers); tests/fairseq/test_option_records.py checks it reaches every table.
"""

from typing import Dict

from ..common.config_value import config_value
from ..moe.placement import side_moe_freq
from .criterion import CRITERION_OPTIONS, DISTILL_OPTIONS
from .inference import INFERENCE_OPTIONS  # noqa: F401  (re-exported)
from .model import MODEL_OPTIONS as _MODEL
from .model import TRANSLATION_OPTIONS
from .record import CRITERION, EVERY_ARCH, INFERENCE, TRANSLATION, Option, Range  # noqa: F401  (re-exported)
from .run import RUN_OPTIONS

# Every architecture's options in the order argparse and docs/options.md list them, then the
# translation architectures' own.
ARCH_OPTIONS = _MODEL + RUN_OPTIONS
MODEL_OPTIONS = ARCH_OPTIONS + TRANSLATION_OPTIONS
# The options a checkpoint's cfg saves (the inference CLIs' flags are never saved).
SAVED_OPTIONS = MODEL_OPTIONS + CRITERION_OPTIONS + DISTILL_OPTIONS
OPTIONS: Dict[str, Option] = {o.name: o for o in SAVED_OPTIONS + INFERENCE_OPTIONS}

# The layer-config field each option sets ("routing.k"), and back: the flag a layer config's field is
# named by in a message.
FIELD_OF: Dict[str, str] = {o.name: o.field for o in MODEL_OPTIONS if o.field}
FLAG_OF_FIELD: Dict[str, str] = {o.field.rsplit(".", 1)[-1]: o.flag for o in MODEL_OPTIONS if o.field}
HF_NAMES: Dict[str, str] = {o.name: o.hf for o in MODEL_OPTIONS if o.hf}
BRANCH_NAMES: Dict[str, str] = {o.name: o.branch for o in MODEL_OPTIONS if o.branch}


def default(name: str):
    """The default of option ``name``, as its record declares it."""
    return OPTIONS[name].default


def option_value(cfg, name: str):
    """``cfg``'s value of option ``name`` (any config: Namespace, omegaconf, dict; its default where ``cfg``
    lacks it), parsed and typed by its record (``Option.read``). Inside this package only: every other
    module reads ``moe_options(cfg).<name>``, so no option is read by a string it spells."""
    return OPTIONS[name].read(cfg)


class OptionValues:
    """Every option's value in one config, as attributes: ``moe_options(args).moe_freeze`` (a frozenset of
    parts), ``.moe_router`` (a StrEnum member, equal to ``"top"``), ``.moe_expert_count``. Each is read, parsed
    and checked when first asked for, then kept; a name that is no option's is an AttributeError."""

    def __init__(self, cfg, as_saved: bool = False):
        self._cfg, self._as_saved, self._read = cfg, as_saved, {}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        option = OPTIONS.get(name)
        if option is None:
            raise AttributeError(f"no option record is named {name!r} (fairseq_moe_ext/options/)")
        if name not in self._read:
            self._read[name] = option.read(self._cfg, self._as_saved)
        return self._read[name]


def moe_options(cfg, as_saved: bool = False) -> OptionValues:
    """The one way to read the plugin's options: ``moe_options(cfg).<option name>``. ``as_saved``: None for an
    option ``cfg`` does not hold (a checkpoint's config written before it existed, or by another project),
    instead of its default."""
    return OptionValues(cfg, as_saved)


def fill_defaults(args, names) -> None:
    """Set each option of ``names`` that ``args`` (an argparse Namespace) lacks, or holds as None, to its
    record's default as the command line would give it (the architecture functions' job: a saved config then
    holds every option)."""
    for name in names:
        setattr(args, name, config_value(args, name, OPTIONS[name].default))


def moe_freq(cfg, side: str) -> int:
    """The MoE layer frequency of ``side`` ("encoder" or "decoder"): --{side}-moe-freq, else --moe-freq,
    their defaults where ``cfg`` lacks them. Models, upcycling and the resume check all read it here."""
    return side_moe_freq(option_value(cfg, "moe_freq"), option_value(cfg, f"{side}_moe_freq"))


def expert_count(cfg, side: str) -> int:
    """Experts in each MoE layer of ``side`` ("encoder" or "decoder"): --{side}-moe-expert-count, else
    --moe-expert-count, their defaults where ``cfg`` lacks them. Models, prune, reshard and export read it here."""
    own = option_value(cfg, f"{side}_moe_expert_count")
    return int(option_value(cfg, "moe_expert_count") if own is None else own)


def architecture_defaults(args, **defaults) -> None:
    """An architecture's own defaults (``moe_expert_count=4`` for the tiny ones), each set where ``args`` lacks
    the option or holds None (fairseq's architecture functions: None means not given)."""
    for name, value in defaults.items():
        OPTIONS[name]  # noqa: B018  (a name that is no option's record is a KeyError, not a new attribute)
        if config_value(args, name) is None:
            setattr(args, name, value)


def layer_fields(cfg) -> Dict:
    """The ``MoELayerConfig`` fields the flags set, by their flat names (``MoELayerConfig.of``): each
    record's ``field``, its value converted by ``to_field`` or as the field holds it. ``hidden_dim`` is
    None where --moe-expert-ffn-dim is unset (the layer's ffn dim, which the caller knows)."""

    def read(name):
        return option_value(cfg, name)

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


def record_problems():
    """One line per incomplete record or name declared twice (empty: every record is whole)."""
    found = [line for o in OPTIONS.values() for line in o.problems()]
    if len(OPTIONS) != len(SAVED_OPTIONS) + len(INFERENCE_OPTIONS):
        found.append("an option name is declared by two records")
    return found
