"""Each ``--moe-*`` option is one record (``fairseq_moe_ext/options/``), and every table that names an
option is read from the records: the fairseq dataclasses (hence argparse and docs/options.md), the
ranges, the resume policy, the MoE layer's config, the Hugging Face and nllb-branch names. Here: every
record is whole, reaches every table it should, and no table names an option that has no record."""

import argparse
import dataclasses
import inspect

import pytest
from fairseq.dataclass.utils import gen_parser_from_dataclass

from fairseq_moe_ext.checkpoint.branch.options import branch_flags
from fairseq_moe_ext.checkpoint.hf.config import HF_DEFAULTS, hf_config, imported_options
from fairseq_moe_ext.criterions.distillation import DistillationOptions, MoEDistillationCriterion
from fairseq_moe_ext.criterions.moe_criterions import (
    MoECrossEntropyCriterion,
    MoELabelSmoothedCrossEntropyCriterion,
    MoELossConfig,
)
from fairseq_moe_ext.fairseq_integration.inference import add_inference_experts_flag
from fairseq_moe_ext.fairseq_integration.reference_docs import options_markdown
from fairseq_moe_ext.models.moe_config import (
    MOE_OPTIONS,
    MoEConfig,
    MoEEncoderDecoderConfig,
    check_moe_args,
)
from fairseq_moe_ext.models.moe_layers import moe_layer_config
from fairseq_moe_ext.models.moe_transformer import NOT_SET_BY_ARCHITECTURE
from fairseq_moe_ext.moe import MoELayerConfig, RoutingConfig
from fairseq_moe_ext.options import (
    ARCH_OPTIONS,
    BRANCH_NAMES,
    CRITERION_OPTIONS,
    DISTILL_OPTIONS,
    HF_NAMES,
    INFERENCE_OPTIONS,
    MODEL_OPTIONS,
    OPTIONS,
    TRANSLATION,
    Option,
    record_problems,
)
from fairseq_moe_ext.options.ranges import CRITERION_RANGES, DISTILL_RANGES, MODEL_RANGES
from fairseq_moe_ext.options.record import CHANGES_FUNCTION, CRITERION
from fairseq_moe_ext.training.resume_policy import POLICY
from support.inputs.model_namespaces import exportable_options, model_defaults

# The layer-config fields the dense layer's own (fairseq) flags or the layer's build set, not an --moe-* flag.
NOT_FROM_A_FLAG = {"model_dim", "activation", "activation_dropout", "bias", "routing"}
# The fairseq options the resume policy decides beside ours.
FAIRSEQ_OPTIONS_IN_POLICY = {"activation_fn"}


def fields_of(config) -> dict:
    """A layer config's fields, routing's flattened in, as MoELayerConfig.of names them."""
    flat = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "routing"}
    return dict(flat, **{f.name: getattr(config.routing, f.name) for f in dataclasses.fields(RoutingConfig)})


def changed(record: Option):
    """A value other than the default that the layer config takes alone."""
    if record.choices:
        return next(choice for choice in reversed(record.choices) if choice != record.default)
    value = {bool: True, int: 16 if record.default is None else record.default + 1, float: 0.5, str: "x"}
    return value[record.value_type]


def test_every_record_is_whole_and_an_incomplete_one_is_named_with_what_it_lacks():
    assert record_problems() == []
    assert [o.name for o in MODEL_OPTIONS + CRITERION_OPTIONS + DISTILL_OPTIONS + INFERENCE_OPTIONS] == list(OPTIONS)
    whole = OPTIONS["moe_top_k"]
    assert dataclasses.replace(whole, help=" ").problems() == [
        "moe_top_k: every record says what it does (help) and why it may change or not (why)"
    ]
    assert "resume must be one of" in dataclasses.replace(whole, resume="sometimes").problems()[0]
    assert "to_field without the field" in dataclasses.replace(whole, field=None, to_field=abs).problems()[0]
    assert "not one of its choices" in dataclasses.replace(OPTIONS["moe_router"], default="hash").problems()[0]


def test_the_fairseq_dataclasses_and_argparse_hold_each_record_s_type_default_and_help():
    arch = [f for f in dataclasses.fields(MoEConfig) if f.name != "_name"]
    assert [f.name for f in arch] == [o.name for o in ARCH_OPTIONS]
    translation = [
        f.name for f in dataclasses.fields(MoEEncoderDecoderConfig) if f.name not in MoEConfig.__dataclass_fields__
    ]
    assert translation == [o.name for o in MODEL_OPTIONS if o.where == TRANSLATION]
    assert [f.name for f in dataclasses.fields(MoELossConfig) if f.name != "_name"] == [
        o.name for o in CRITERION_OPTIONS
    ]
    assert [f.name for f in dataclasses.fields(DistillationOptions) if f.name != "_name"] == [
        o.name for o in DISTILL_OPTIONS
    ]
    assert MOE_OPTIONS == tuple(o.name for o in MODEL_OPTIONS)
    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, MoEEncoderDecoderConfig())
    gen_parser_from_dataclass(parser, MoELossConfig())
    gen_parser_from_dataclass(parser, DistillationOptions())
    add_inference_experts_flag(parser)  # the inference CLIs' flags, added to their parsers
    actions = {a.dest: a for a in parser._actions}
    assert {name for name in actions if "moe" in name or name.startswith("distill_")} == set(OPTIONS)
    for o in OPTIONS.values():
        action = actions[o.name]
        assert (action.option_strings, action.default, action.help) == ([o.flag], o.default, o.help), o.name
        assert list(action.choices or ()) == list(o.choices), o.name
        assert f"| `{o.flag}` |" in options_markdown()


def test_each_range_resume_rule_and_launch_only_flag_is_its_record_s_and_nothing_else():
    assert MODEL_RANGES == {o.name: o.range for o in MODEL_OPTIONS if o.range}
    assert CRITERION_RANGES == {o.name: o.range for o in CRITERION_OPTIONS if o.range}
    assert DISTILL_RANGES == {o.name: o.range for o in DISTILL_OPTIONS if o.range}
    ranges = {**MODEL_RANGES, **CRITERION_RANGES, **DISTILL_RANGES}
    assert all(spec.flag == OPTIONS[name].flag for name, spec in ranges.items())
    saved = {o.name: o for o in MODEL_OPTIONS + CRITERION_OPTIONS + DISTILL_OPTIONS}  # inference flags are never saved
    assert set(POLICY) == set(saved) | FAIRSEQ_OPTIONS_IN_POLICY
    for name, o in saved.items():
        rule = POLICY[name]
        assert (rule.kind, rule.why, rule.section, rule.effective) == (o.resume, o.why, o.section, o.effective)
    assert POLICY["activation_fn"].kind == CHANGES_FUNCTION
    assert set(NOT_SET_BY_ARCHITECTURE) == {o.name for o in OPTIONS.values() if o.launch_only}


def test_the_criterions_take_each_criterion_record_with_the_record_s_default():
    for criterion in (MoECrossEntropyCriterion, MoELabelSmoothedCrossEntropyCriterion, MoEDistillationCriterion):
        parameters = inspect.signature(criterion.__init__).parameters
        assert {name for name in parameters if name.startswith("moe_")} == {o.name for o in CRITERION_OPTIONS}
        records = CRITERION_OPTIONS + (DISTILL_OPTIONS if criterion is MoEDistillationCriterion else ())
        assert {name for name in parameters if name.startswith("distill_")} == {o.name for o in records} - {
            o.name for o in CRITERION_OPTIONS
        }
        for o in records:
            assert o.where == CRITERION and parameters[o.name].default == o.default, (criterion, o.name)


@pytest.mark.parametrize("record", [o for o in MODEL_OPTIONS if o.field], ids=lambda o: o.name)
def test_each_layer_flag_changes_exactly_the_layer_field_its_record_names(record):
    base = model_defaults(moe_balance="bias")  # --moe-bias-update-rate acts only with it
    before = fields_of(moe_layer_config(base, model_dim=8, ffn_dim=32))
    after = fields_of(moe_layer_config(model_defaults(moe_balance="bias", **{record.name: changed(record)}), 8, 32))
    assert {name for name in before if before[name] != after[name]} == {record.field.rsplit(".", 1)[-1]}


def test_every_layer_config_field_is_set_by_a_record_or_by_the_dense_layer_s_own_flags():
    layer = {f.name for f in dataclasses.fields(MoELayerConfig)} | {f.name for f in dataclasses.fields(RoutingConfig)}
    by_records = {o.field.rsplit(".", 1)[-1] for o in MODEL_OPTIONS if o.field}
    assert layer - NOT_FROM_A_FLAG == by_records
    assert all(o.field.split(".")[0] in ("routing", o.field) for o in MODEL_OPTIONS if o.field)


# (flags, the line in field words MoELayerConfig.of says, the line in flag words check_moe_args says)
# fmt: off
CONFLICTS = [
    (dict(moe_top_k=5, moe_expert_count=4), "k=5 exceeds num_experts=4: use k <= 4",
     "--moe-top-k 5 exceeds --moe-expert-count 4: use --moe-top-k <= 4"),
    (dict(moe_router="sigmoid", moe_top_k=1),
     "router_type=sigmoid normalises the gates over the chosen experts, so with k=1 every gate is 1 and the router "
     "never learns: use k 2 or more, or router_type=top",
     "--moe-router sigmoid normalises the gates over the chosen experts, so with --moe-top-k 1 every gate is 1 and "
     "the router never learns: use --moe-top-k 2 or more, or --moe-router top"),
    (dict(moe_second_expert_policy="sampling", moe_router="cosine"),
     "second_expert_policy=sampling is defined for the nllb branch's top-2 softmax routing: use k=2 with "
     "router_type=top, or drop second_expert_policy",
     "--moe-second-expert-policy sampling is defined for the nllb branch's top-2 softmax routing: use --moe-top-k 2 "
     "with --moe-router top, or drop --moe-second-expert-policy"),
    (dict(moe_normalize_gate_after_dropping=True, moe_router="sigmoid"),
     "normalize_gates_after_dropping renormalises softmax probabilities: use it with router_type=top, or drop it",
     "--moe-normalize-gate-after-dropping renormalises softmax probabilities: use it with --moe-router top, or "
     "drop it"),
]
# fmt: on


@pytest.mark.parametrize("flags, in_fields, in_flags", CONFLICTS, ids=["k-above-e", "sigmoid-k1", "policy", "after"])
def test_a_rule_between_options_is_written_once_and_told_in_field_or_flag_words(flags, in_fields, in_flags):
    fields = {OPTIONS[name].field.rsplit(".", 1)[-1]: value for name, value in flags.items()}
    with pytest.raises(ValueError) as by_fields:
        MoELayerConfig.of(model_dim=8, hidden_dim=16, **{"num_experts": 8, **fields})
    with pytest.raises(ValueError) as by_flags:
        check_moe_args(model_defaults(**flags))
    assert (str(by_fields.value), str(by_flags.value)) == (in_fields, in_flags)


@pytest.mark.parametrize("name", sorted(HF_NAMES))
def test_each_option_carried_to_nllb_moe_goes_out_under_its_hf_name_and_comes_back(name):
    record = OPTIONS[name]
    value = 0.2 if record.type is float else changed(record)
    config, _ = hf_config(exportable_options(**{name: value}), "ck.pt", vocab=30, dtype="float32")
    assert config[HF_NAMES[name]] == value and HF_NAMES[name] in {**HF_DEFAULTS, "num_experts": 0}
    assert getattr(imported_options(config, "config.json")[0], name) == value


@pytest.mark.parametrize("name", sorted(BRANCH_NAMES))
def test_each_option_carried_from_the_nllb_branch_is_read_under_its_branch_name(name):
    value = changed(OPTIONS[name])
    branch = argparse.Namespace(arch="transformer", moe_freq=2, **{BRANCH_NAMES[name]: value})
    assert branch_flags(branch, "ck.pt", {"encoder": 2, "decoder": 2})[0][name] == value
