"""Every numeric option is checked at start-up against the range of what it is used in: one table
over all of them and the values that break a type-only check (0, negative, NaN, inf, 1e39, a huge
integer, a tiny number), run through the same start-up checks fairseq-train runs (the models' and
criterions', and the checkpoint tool's ``upcycle`` command line). The expected outcome of every cell
is written here, not read from ``options.ranges``; a second test checks each bound against what
holds the value (torch, a timedelta)."""

import argparse
import dataclasses
import math
import typing
from datetime import timedelta

import pytest
import torch

from fairseq_moe_ext.checkpoint import __main__ as tool
from fairseq_moe_ext.criterions.moe_criterions import MoELossConfig, MoELossMixin
from fairseq_moe_ext.models.moe_config import MoEEncoderDecoderConfig, check_moe_args, check_moe_layers_placed
from fairseq_moe_ext.moe.capacity import expert_capacity_tensor, slots_within_capacity
from fairseq_moe_ext.options import ranges as option_ranges

# fmt: off
VALUES = {"zero": 0, "negative": -1, "nan": math.nan, "inf": math.inf, "1e39": 1e39, "huge-integer": 10 ** 40,
          "beyond-float": 10 ** 400, "tiny": 1e-50, "ten-million": 10 ** 7}
# fmt: on
OK = "accepted"
# codes of the refusals: "type" <flag> must be <requirement>, got <value>; "high" <flag> <value> is more than
# <holder> can hold, or is beyond the largest real models' size it is bounded by; "small" ... is less than <holder> can hold; "placed": the frequency places no MoE layer
# ten-million: held by int64 and fp32, but more experts (or FFN width, or workers) than any real model uses.
ORDER = ("zero", "negative", "nan", "inf", "1e39", "huge-integer", "beyond-float", "tiny", "ten-million")


def row(flag, requirement, codes, context=None, parsed=None):
    """``parsed``: what the command line makes of the value's text (the tool's rows)."""
    codes = codes.split()
    assert len(codes) == len(ORDER)
    return dict(
        flag=flag,
        requirement=requirement,
        outcomes=dict(zip(ORDER, codes)),
        context=context or {},
        parsed=parsed or (lambda value: value),
    )


# option -> its flag, requirement, and the outcome for each value in ORDER
# fmt: off
MODEL = {
    "moe_expert_count": row("--moe-expert-count", "a positive integer", "type type type type type high high type high"),
    "moe_expert_parallel_size": row("--moe-expert-parallel-size", "a positive integer",
                                    "type type type type type high high type high"),
    "moe_freq": row("--moe-freq", "an integer >= 0", "placed type type type type placed placed type placed"),
    "encoder_moe_freq": row("--encoder-moe-freq", "an integer >= 0", "ok type type type type ok ok type ok"),
    "decoder_moe_freq": row("--decoder-moe-freq", "an integer >= 0", "ok type type type type ok ok type ok"),
    "encoder_moe_expert_count": row("--encoder-moe-expert-count", "a positive integer",
                                    "type type type type type high high type high"),
    "decoder_moe_expert_count": row("--decoder-moe-expert-count", "a positive integer",
                                    "type type type type type high high type high"),
    "moe_top_k": row("--moe-top-k", "an integer >= 1", "type type type type type high high type high"),
    "moe_capacity_factor": row("--moe-capacity-factor", "a finite number", "ok ok type type ok ok type ok ok"),
    "moe_eval_capacity_factor": row("--moe-eval-capacity-factor", "a finite number", "ok ok type type ok ok type ok ok"),
    "moe_eval_capacity_token_fraction": row("--moe-eval-capacity-token-fraction", "a finite number >= 0",
                                            "ok type type type ok ok type ok ok"),
    "moe_gate_noise": row("--moe-gate-noise", "a finite number >= 0", "ok type type type high high type ok ok"),
    "moe_eom": row("--moe-eom", "a probability in [0, 1)", "ok type type type high high type ok high"),
    "moe_shared_expert_count": row("--moe-shared-expert-count", "an integer >= 0",
                                   "ok type type type type high high type high"),
    "moe_shared_expert_ffn_dim": row("--moe-shared-expert-ffn-dim", "a positive integer",
                                     "type type type type type high high type high",
                                     context=dict(moe_shared_expert_count=1)),
    "moe_bias_update_rate": row("--moe-bias-update-rate", "a finite number > 0",
                                "type type type type high high type small ok", context=dict(moe_balance="bias")),
    "moe_expert_ffn_dim": row("--moe-expert-ffn-dim", "a positive integer", "type type type type type high high type high"),
    "moe_comm_timeout": row("--moe-comm-timeout", "a positive number of seconds",
                            "type type type type high high type small ok"),
    "moe_upcycle_noise": row("--moe-upcycle-noise", "a finite number >= 0", "ok type type type high high type ok ok"),
    "moe_upcycle_router_std": row("--moe-upcycle-router-std", "a finite number >= 0",
                                  "ok type type type high high type ok ok"),
}
# fmt: on
# fmt: off
CRITERION = {
    "moe_gate_loss_wt": row("--moe-gate-loss-wt", "a finite number >= 0", "ok type type type high high type ok ok"),
    "moe_z_loss_wt": row("--moe-z-loss-wt", "a finite number >= 0", "ok type type type high high type ok ok"),
}
# fmt: on
# The checkpoint tool's upcycle flags; "parser": argparse itself refuses the text (an int flag given a float).
# fmt: off
UPCYCLE_TOOL = {
    "noise": row("--noise", "a finite number >= 0", "ok type type type high high type ok ok",
                 parsed=lambda v: float(as_text(v))),
    "router_std": row("--router-std", "a finite number >= 0", "ok type type type high high type ok ok",
                      parsed=lambda v: float(as_text(v))),
    "seed": row("--seed", "an integer >= 0", "ok type parser parser parser high high parser ok",
                parsed=lambda v: int(as_text(v))),
}
# fmt: on


def start_a_model(name, value, context):
    """What fairseq-train checks before building a 2+2-layer MoE translation model."""
    args = argparse.Namespace(encoder_layers=2, decoder_layers=2, **context, **{name: value})
    check_moe_args(args)
    check_moe_layers_placed(args, ("encoder", "decoder"))


def start_a_criterion(name, value, context):
    weights = {"moe_gate_loss_wt": 0.01, "moe_z_loss_wt": 0.0, name: value}
    MoELossMixin._init_moe_loss(
        argparse.Namespace(), moe_gate_loss_combine_method="average", moe_hide_expert_load=False, **weights
    )


def as_text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def run_the_upcycle_tool(name, value, context, tmp_path=None, capsys=None):
    """The tool refuses a bad flag before it looks for the (missing) checkpoint."""
    flag = "--" + name.replace("_", "-")
    text = as_text(value)
    code = tool.main(
        ["upcycle", str(tmp_path / "no-such-dense.pt"), str(tmp_path / "out.pt"), "--moe-expert-count", "4", flag, text]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    if "no checkpoint named" in err[0]:
        return
    raise ValueError(err[0].removeprefix("error: "))


STARTS = ((start_a_model, MODEL), (start_a_criterion, CRITERION), (run_the_upcycle_tool, UPCYCLE_TOOL))
# fmt: off
CELLS = [pytest.param(start, name, spec, value_id, id=f"{name}={value_id}")
         for start, table in STARTS
         for name, spec in table.items() for value_id in ORDER]
# fmt: on


@pytest.mark.parametrize("start, name, spec, value_id", CELLS)
def test_every_numeric_option_is_refused_in_one_line_outside_its_range_and_taken_inside(
    start, name, spec, value_id, tmp_path, capsys
):
    value, outcome = VALUES[value_id], spec["outcomes"][value_id]
    shown = spec["parsed"](value) if outcome not in ("ok", "parser") else value
    extra = dict(tmp_path=tmp_path, capsys=capsys) if start is run_the_upcycle_tool else {}
    if outcome == "parser":
        with pytest.raises(SystemExit):
            start(name, value, spec["context"], **extra)
        assert "invalid int value" in capsys.readouterr().err
        return
    if outcome == "ok":
        start(name, value, spec["context"], **extra)
        return
    with pytest.raises(ValueError) as refused:
        start(name, value, spec["context"], **extra)
    line = str(refused.value)
    assert "\n" not in line
    expected = {
        "type": f"{spec['flag']} must be {spec['requirement']}, got {shown!r}: ",
        "high": (f"{spec['flag']} {shown!r} is more than ", f"{spec['flag']} {shown!r} is beyond "),
        "small": f"{spec['flag']} {shown!r} is less than ",
        "placed": f"{spec['flag']} {shown} places no MoE layer in this model",
    }[outcome]
    assert line.startswith(expected if isinstance(expected, tuple) else (expected,)), line
    assert ": use " in line or ": drop it" in line, f"no fix named: {line}"


NUMBERS = (int, float)


def numeric_fields(config):
    """The fields of a fairseq dataclass whose values are numbers (Optional ones included)."""
    hints = typing.get_type_hints(config)
    found = []
    for spec in dataclasses.fields(config):
        kinds = typing.get_args(hints[spec.name]) or (hints[spec.name],)
        if spec.name != "_name" and any(k in NUMBERS for k in kinds) and bool not in kinds:
            found.append(spec.name)
    return set(found)


def test_every_numeric_option_of_the_architectures_and_criterions_has_a_range_and_a_row_here():
    model, criterion = numeric_fields(MoEEncoderDecoderConfig), numeric_fields(MoELossConfig)
    model = {name for name in model if name.startswith("moe_") or "_moe_" in name}
    assert model == set(option_ranges.MODEL_RANGES) == set(MODEL)
    assert {n for n in criterion if n.startswith("moe_")} == set(option_ranges.CRITERION_RANGES) == set(CRITERION)
    assert set(option_ranges.UPCYCLE_TOOL_RANGES) == set(UPCYCLE_TOOL)


def test_each_bound_is_where_what_holds_the_value_stops_holding_it():
    # The fp32 balance bias: the largest rate accepted moves it, a larger one cannot be converted,
    # the smallest accepted still moves it, a smaller one is 0 there.
    bias = torch.zeros(2)
    bias.add_(torch.tensor([1.0, -1.0]), alpha=option_ranges.FP32_MAX)
    assert torch.isfinite(bias).all() and bias[0] > 0
    with pytest.raises(RuntimeError, match="overflow"):
        torch.zeros(2).add_(torch.ones(2), alpha=1e39)
    assert torch.zeros(1).add_(torch.ones(1), alpha=option_ranges.FP32_SMALLEST).item() > 0
    assert torch.zeros(1).add_(torch.ones(1), alpha=1e-50).item() == 0
    # The timedelta of the expert groups' timeout, and torch's millisecond timeouts below it.
    assert timedelta(seconds=option_ranges.TIMEDELTA_MAX_S) == timedelta(days=timedelta.max.days)
    with pytest.raises(OverflowError):
        timedelta(seconds=1e39)
    assert timedelta(seconds=0.001) // timedelta(milliseconds=1) == 1
    # Tensor sizes are int64; torch's generator seeds are uint64.
    assert torch.empty(0, option_ranges.INT64_MAX).shape[1] == option_ranges.INT64_MAX
    with pytest.raises((RuntimeError, TypeError), match="Overflow"):
        torch.empty(0, option_ranges.INT64_MAX + 1)
    torch.Generator().manual_seed(2**64 - 1)
    with pytest.raises((RuntimeError, ValueError), match="Overflow"):
        torch.Generator().manual_seed(2**64)


@pytest.mark.parametrize("factor", [1e39, -1e39, 1e300])
def test_a_capacity_factor_beyond_the_token_count_keeps_every_slot_as_dropless_routing_does(factor):
    """A finite factor is accepted at start-up whatever its size; cast to int64 unchecked, 1e39 tokens
    per expert wrapped to a capacity of 0 and dropped every slot."""
    experts, k, tokens = 4, 2, 100
    expert_index = torch.stack([torch.arange(tokens) % experts, (torch.arange(tokens) + 1) % experts], dim=1)
    capacity = expert_capacity_tensor(torch.tensor(tokens), experts, k, factor)
    assert capacity.item() > 0
    assert slots_within_capacity(expert_index, experts, capacity).all()
