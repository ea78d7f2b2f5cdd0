"""What may change when a run resumes, option by option (``training/resume_policy.POLICY``).

One test per row: an option that changes what the saved weights compute is refused in one line
naming the flag, both values and the fix (and resumes, logged as a warning, with
--moe-allow-function-change); an option that may change resumes and is logged; an option that gives
the model other parameters is refused by the parameter check, naming the flag or the tensor, whatever
the override says. The command-line cases are rows of tests/cli/test_bad_input_options.py.
"""

import argparse
import logging

import pytest

from fairseq import tasks
from fairseq_moe_ext.checkpoint.compat import check_resumable
from fairseq_moe_ext.criterions.distillation import MoEDistillationConfig
from fairseq_moe_ext.models.moe_config import MOE_OPTIONS
from fairseq_moe_ext.options import default
from fairseq_moe_ext.training.resume_policy import (
    CHANGES_FUNCTION,
    CHANGES_PARAMETERS,
    OVERRIDE_FLAG,
    POLICY,
    check_resume_policy,
)
from support.inputs.tiny_fairseq_models import train_config
from support.launch.fairseq_helpers import translation_flags

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
PATH = "ck/checkpoint_last.pt"

# option -> (what a change of it does on resume, value the checkpoint was trained with, value this run
# has); written here, not read from the policy. Criterion options live in the criterion's section.
FUNCTION, FREE = "refused unless overridden", "resumes, logged"
# fmt: off
CHANGED = {
    "moe_router": (FUNCTION, "top", "sigmoid"),
    "moe_top_k": (FUNCTION, 2, 1),
    "moe_normalize_gate": (FUNCTION, False, True),
    "moe_eom": (FUNCTION, 0.0, 0.2),
    "moe_second_expert_policy": (FUNCTION, "all", "sampling"),
    "moe_normalize_gate_after_dropping": (FUNCTION, False, True),
    "activation_fn": (FUNCTION, "relu", "gelu"),
    "moe_capacity_factor": (FREE, 1.25, 2.0),
    "moe_eval_capacity_factor": (FREE, 0.0, 1.0),
    "moe_batch_prioritized_routing": (FREE, False, True),
    "moe_batch_major_routing": (FREE, False, True),
    "moe_eval_capacity_token_fraction": (FREE, 0.0, 0.25),
    "moe_gate_noise": (FREE, 0.0, 1.0),
    "moe_normalize_expert_grad": (FREE, "world_size", "sqrt_world_size"),
    "moe_bias_update_rate": (FREE, None, 0.01),  # None: the default rate, 0.001
    "moe_gating_no_fp32": (FREE, False, True),
    "moe_gating_use_fp32": (FREE, False, True),
    "moe_expert_parallel_size": (FREE, None, 2),
    "moe_fully_sharded_unit": (FREE, "layer", "model"),
    "moe_fully_sharded_experts": (FREE, "whole", "sharded"),
    "moe_comm_timeout": (FREE, 1800.0, 600.0),
    "moe_deterministic": (FREE, False, True),
    "moe_restore_fallback": (FREE, False, True),
    "moe_allow_function_change": (FREE, False, True),
    "moe_upcycle_from": (FREE, "dense/checkpoint_last.pt", None),
    "moe_upcycle_noise": (FREE, 0.0, 0.001),
    "moe_upcycle_router_std": (FREE, 0.0, 0.01),
    "moe_balance_scope": (FREE, "micro-batch", "global-batch"),
    "moe_freeze": (FREE, None, "router"),
    "moe_gate_loss_wt": (FREE, 0.01, 0.1),
    "moe_z_loss_wt": (FREE, 0.0, 0.001),
    "moe_gate_loss_combine_method": (FREE, "average", "sum"),
    "moe_hide_expert_load": (FREE, False, True),
    # --criterion moe_distillation: which teacher and how it teaches (it is read again at every launch)
    "distill_teacher": (FREE, "teacher/checkpoint_best.pt", "other/checkpoint_best.pt"),
    "distill_weight": (FREE, 0.5, 0.8),
    "distill_temperature": (FREE, 1.0, 2.0),
    "distill_top_k": (FREE, 0, 8),
    "distill_teacher_dtype": (FREE, "student", "bfloat16"),
    "distill_teacher_experts": (FREE, "auto", "local"),
}
# fmt: on


CRITERION_OPTIONS = {
    name for name in MoEDistillationConfig.__dataclass_fields__ if name.startswith(("moe_", "distill_"))
}  # the distillation criterion's: the MoE criterions' and its own


def spelled(name, value):
    """How a value is named in the messages: a flag that takes no value is given or not, an unset
    one is unset, an unset rate is the default rate the run uses."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    if value is None:
        return f"{flag} 0.001" if name == "moe_bias_update_rate" else f"{flag} unset"
    return f"{flag} {value}"


def configs(name, saved_value, current_value):
    """The checkpoint's cfg and this run's model and criterion sections, equal but for ``name``."""
    model = {n: default(n) for n in MOE_OPTIONS}
    model.update(activation_fn="relu", moe_balance="bias")  # bias: its rate is read
    criterion = {name: MoEDistillationConfig.__dataclass_fields__[name].default for name in CRITERION_OPTIONS}
    section = "criterion" if name in CRITERION_OPTIONS else "model"
    saved = {"model": dict(model), "criterion": dict(criterion)}
    saved[section][name] = saved_value
    current = {"model": argparse.Namespace(**model), "criterion": argparse.Namespace(**criterion)}
    setattr(current[section], name, current_value)
    return saved, current


def test_every_moe_option_and_the_expert_activation_has_a_row():
    assert set(POLICY) == set(MOE_OPTIONS) | CRITERION_OPTIONS | {"activation_fn"}
    assert {name for name, rule in POLICY.items() if rule.kind != CHANGES_PARAMETERS} == set(CHANGED)


FUNCTION_ROWS = [name for name, (kind, _, _) in CHANGED.items() if kind == FUNCTION]
FREE_ROWS = [name for name, (kind, _, _) in CHANGED.items() if kind == FREE]


@pytest.mark.parametrize("name", FUNCTION_ROWS)
def test_an_option_changing_what_the_weights_compute_is_refused_unless_overridden(name, caplog):
    _, was, now = CHANGED[name]
    saved, current = configs(name, was, now)
    with pytest.raises(ValueError) as refused:
        check_resume_policy(PATH, saved, current["model"], current["criterion"], allow_function_change=False)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(
        f"{PATH} was trained with {spelled(name, was)} and this run has {spelled(name, now)}, which {CHANGES_FUNCTION}"
    ), line
    fix = f"resume without --{name.replace('_', '-')}" if was is False else f"resume with {spelled(name, was)}"
    assert f": {fix}, or use a new --save-dir, or add {OVERRIDE_FLAG}" in line, line
    with caplog.at_level(logging.INFO):
        logged = check_resume_policy(PATH, saved, current["model"], current["criterion"], allow_function_change=True)
    assert len(logged) == 1 and logged[0].startswith(f"{OVERRIDE_FLAG}: {PATH} was trained with {spelled(name, was)}")
    assert [r.levelno for r in caplog.records if r.getMessage() == logged[0]] == [logging.WARNING]


@pytest.mark.parametrize("name", FREE_ROWS)
def test_an_option_that_may_change_on_resume_resumes_and_the_change_is_logged(name, caplog):
    _, was, now = CHANGED[name]
    saved, current = configs(name, was, now)
    with caplog.at_level(logging.INFO):
        logged = check_resume_policy(PATH, saved, current["model"], current["criterion"], allow_function_change=False)
    assert len(logged) == 1 and "it may change on resume" in logged[0]
    assert logged[0].startswith(f"resuming: {PATH} was trained with {spelled(name, was)} and this run has "), logged[0]
    assert [r.levelno for r in caplog.records if r.getMessage() == logged[0]] == [logging.INFO]


def test_an_unchanged_option_and_one_the_checkpoint_does_not_record_log_nothing():
    saved, current = configs("moe_top_k", 2, 2)
    del saved["model"]["moe_normalize_gate"]  # a checkpoint written before the option existed
    current["model"].moe_normalize_gate = True
    assert check_resume_policy(PATH, saved, current["model"], current["criterion"], False) == []


# ------------------------------------------------------------------ options that give other parameters


def build(data, *flags):
    """A moe_transformer_tiny model as fairseq-train builds it, and its cfg."""
    cfg = train_config([*translation_flags(data, "moe_transformer_tiny"), "--cpu", "--seed", "1", *flags])
    return tasks.setup_task(cfg.task).build_model(cfg.model), cfg


# option -> (flags the checkpoint was trained with, this run's flags, what the refusal names)
# fmt: off
OTHER_PARAMETERS = {
    "moe_expert_count": ([], ["--moe-expert-count", "8"], "holds 4 experts in encoder.layers.1.fc1, this model 8: "
                         "resume with the checkpoint's --moe-expert-count"),
    "encoder_moe_expert_count": ([], ["--encoder-moe-expert-count", "8"], "holds 4 experts in encoder.layers.1.fc1, "
                                 "this model 8: resume with the checkpoint's --encoder-moe-expert-count"),
    "decoder_moe_expert_count": ([], ["--decoder-moe-expert-count", "2"], "holds 4 experts in decoder.layers.1.fc1, "
                                 "this model 2: resume with the checkpoint's --decoder-moe-expert-count"),
    "moe_freq": ([], ["--moe-freq", "1"], "was trained with --moe-freq 2 and this run has --moe-freq 1, which gives "
                 "the model other parameters: resume with --moe-freq 2"),
    "encoder_moe_freq": ([], ["--encoder-moe-freq", "1"], "was trained with --moe-freq 2 and this run has "
                         "--encoder-moe-freq 1, which gives the model other parameters"),
    "decoder_moe_freq": ([], ["--decoder-moe-freq", "1"], "was trained with --moe-freq 2 and this run has "
                         "--decoder-moe-freq 1, which gives the model other parameters"),
    "moe_expert_ffn_dim": ([], ["--moe-expert-ffn-dim", "256"], "does not fit this model: "
                           "encoder.layers.1.fc1.experts.batched_fc1_w is (4, 128, 64) there and (4, 256, 64) here"),
    "moe_shared_expert_count": ([], ["--moe-shared-expert-count", "1"], "was trained with --moe-shared-expert-count 0 "
                                "and this run has --moe-shared-expert-count 1, which gives the model other parameters"),
    "moe_shared_expert_ffn_dim": (["--moe-shared-expert-count", "1"],
                                  ["--moe-shared-expert-count", "1", "--moe-shared-expert-ffn-dim", "64"],
                                  "does not fit this model: encoder.layers.1.fc1.shared_experts"),
    "moe_balance": ([], ["--moe-balance", "bias"], "was trained with --moe-balance none and this run has --moe-balance "
                    "bias, which gives the model other parameters"),
}
# fmt: on


def test_every_row_that_changes_the_parameters_has_a_case_here():
    assert {name for name, rule in POLICY.items() if rule.kind == CHANGES_PARAMETERS} == set(OTHER_PARAMETERS)


@pytest.mark.parametrize("name", sorted(OTHER_PARAMETERS))
def test_an_option_giving_the_model_other_parameters_is_refused_even_if_overridden(data, name):
    trained_flags, flags, names = OTHER_PARAMETERS[name]
    saved_model, saved_cfg = build(data, *trained_flags)
    model, cfg = build(data, *flags, "--moe-allow-function-change")
    state = {"model": saved_model.state_dict(), "cfg": {"model": saved_cfg.model}}
    with pytest.raises(ValueError) as refused:
        check_resumable(PATH, state, model, 1, cfg.model)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(PATH) and names in line, line
    assert line.endswith(", or use a new --save-dir"), line


def test_a_skipped_upcycle_rewords_a_checkpoint_that_cannot_load_but_not_a_policy_refusal():
    """--moe-upcycle-from skipped for the save dir's checkpoint: a checkpoint this model cannot load
    gets the skip's line; one the policy refuses would load, and keeps its own line and fix."""
    from fairseq_moe_ext.fairseq_integration.loading import refuses_the_checkpoint

    saved, current = configs("moe_top_k", 2, 1)
    with pytest.raises(ValueError) as policy:
        check_resume_policy(PATH, saved, current["model"], current["criterion"], allow_function_change=False)
    assert not refuses_the_checkpoint(policy.value)
    assert refuses_the_checkpoint(
        ValueError(f"{PATH} is a dense fairseq checkpoint (no MoE layers), which this MoE model cannot load: ...")
    )
    assert refuses_the_checkpoint(
        Exception(f"Cannot load model parameters from checkpoint {PATH}; please ensure that the architectures match.")
    )
    assert not refuses_the_checkpoint(RuntimeError("MoE all-to-all of token rows across 2 workers failed"))
