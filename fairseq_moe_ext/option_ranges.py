"""Every numeric option of the plugin, checked at start-up against the range of what it is used in.

A type check lets through values that fail much later: ``--moe-bias-update-rate 1e39`` is a float,
but the balance bias it moves is fp32 and dies at the first update ("value cannot be converted to
type float without overflow"); ``--moe-comm-timeout 1e39`` overflows the timedelta the expert groups
are made with. Each row below says what the option must be (finite, positive where it must be), and
where its value ends up, the largest value that holds it (fp32 for what is added to fp32 tensors,
int64 for what becomes a tensor size, a timedelta for seconds) and, where a tiny value would round
to 0 there, the smallest. ``check_option`` turns a value outside its row into one line naming the
flag, the problem and the fix. Torch only; the models, the criterions and the checkpoint tool's
``upcycle`` call it (``MODEL_RANGES``, ``CRITERION_RANGES``, ``UPCYCLE_TOOL_RANGES``).

Not here, because any finite value works: the capacity factors (a factor beyond the expert count
serves every slot, and ``moe/capacity.py`` caps it there) and the MoE layer frequencies (Python
integers; one that places no MoE layer is refused by ``check_moe_layers_placed``).
"""

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
from .moe.refusal import MoEOptionError

FP32_MAX = float(torch.finfo(torch.float32).max)
FP32_SMALLEST = 2.0**-149  # the smallest positive fp32 (subnormal); below half of it fp32 holds 0
INT64_MAX = 2**63 - 1
TIMEDELTA_MAX_S = float(timedelta.max.days * 86400)  # whole days: total_seconds() of the max rounds past it


# fmt: off
@dataclass(frozen=True)
class Range:
    flag: str
    integer: bool
    requirement: str  # what a value must be, as the message says it: "a positive integer"
    fix: str  # may name {experts}: the run's --moe-expert-count
    low: Optional[float] = None  # the smallest value allowed, or the bound it must exceed (low_open)
    low_open: bool = False
    high: Optional[float] = None  # the largest value what holds it can hold ...
    holder: str = ""  # ... and what holds it
    smallest: Optional[float] = None  # a nonzero value below this is 0 in the holder
    optional: bool = False  # None is allowed (the option then follows another one)
# fmt: on


SIZE = "the int64 tensor sizes it becomes"
FP32_LOSS = "the fp32 loss it multiplies"

# fmt: off
MODEL_RANGES = {
    "moe_expert_count": Range("--moe-expert-count", True, "a positive integer", "use 1 or more experts", low=1,
                              high=INT64_MAX, holder=SIZE),
    "moe_expert_parallel_size": Range(
        "--moe-expert-parallel-size", True, "a positive integer",
        "use a P dividing both the number of workers and --moe-expert-count, or drop it for the default (the largest "
        "such P)", low=1, high=INT64_MAX, holder=SIZE, optional=True),
    "moe_freq": Range("--moe-freq", True, "an integer >= 0", "use N for an MoE layer every N layers, or 0 for none",
                      low=0),
    "encoder_moe_freq": Range("--encoder-moe-freq", True, "an integer >= 0",
                              "use N for an MoE layer every N layers, or 0 for none", low=0, optional=True),
    "decoder_moe_freq": Range("--decoder-moe-freq", True, "an integer >= 0",
                              "use N for an MoE layer every N layers, or 0 for none", low=0, optional=True),
    "moe_top_k": Range("--moe-top-k", True, "an integer >= 1", "use 1 <= --moe-top-k <= {experts}", low=1,
                       high=INT64_MAX, holder=SIZE),
    "moe_capacity_factor": Range(
        "--moe-capacity-factor", False, "a finite number",
        "use 0 for dropless routing, > 0 for a fixed capacity, < 0 for a bounded dropless one"),
    "moe_eval_capacity_factor": Range(
        "--moe-eval-capacity-factor", False, "a finite number",
        "use 0 for dropless routing, > 0 for a fixed capacity, < 0 for a bounded dropless one"),
    "moe_eval_capacity_token_fraction": Range(
        "--moe-eval-capacity-token-fraction", False, "a finite number >= 0",
        "use 0 (off), a fraction such as 0.25 (the nllb branch's default) or 1 (nothing dropped)", low=0),
    "moe_gate_noise": Range("--moe-gate-noise", False, "a finite number >= 0",
                            "use 0 (no noise) or a standard deviation > 0", low=0, high=FP32_MAX,
                            holder="the fp32 router scores it is added to"),
    "moe_eom": Range("--moe-eom", False, "a probability in [0, 1)", "use 0 (off) or a rate such as 0.2 (NLLB-200's)",
                     low=0, high=0.999999, holder="a masking rate below 1"),
    "moe_shared_expert_count": Range("--moe-shared-expert-count", True, "an integer >= 0",
                                     "use 0 for no shared experts", low=0, high=INT64_MAX, holder=SIZE),
    "moe_shared_expert_ffn_dim": Range("--moe-shared-expert-ffn-dim", True, "a positive integer",
                                       "drop it to use the routed experts' hidden size", low=1, high=INT64_MAX,
                                       holder=SIZE, optional=True),
    "moe_bias_update_rate": Range("--moe-bias-update-rate", False, "a finite number > 0",
                                  "use e.g. 0.001 (the default, DeepSeek-V3's)", low=0, low_open=True,
                                  high=FP32_MAX, holder="the fp32 balance bias it moves", smallest=FP32_SMALLEST,
                                  optional=True),
    "moe_expert_ffn_dim": Range("--moe-expert-ffn-dim", True, "a positive integer",
                                "drop it to use the layer's ffn dim", low=1, high=INT64_MAX, holder=SIZE,
                                optional=True),
    "moe_comm_timeout": Range("--moe-comm-timeout", False, "a positive number of seconds",
                              "use e.g. 600 (the default)", low=0, low_open=True, high=TIMEDELTA_MAX_S,
                              holder="a timedelta (torch's process-group timeout)", smallest=0.001),
    "moe_upcycle_noise": Range("--moe-upcycle-noise", False, "a finite number >= 0",
                               "use 0 (exact copies) or a small standard deviation such as 0.001", low=0,
                               high=FP32_MAX, holder="the fp32 noise added to the experts"),
    "moe_upcycle_router_std": Range("--moe-upcycle-router-std", False, "a finite number >= 0",
                                    "use 0 (a zero router) or a small standard deviation such as 0.01", low=0,
                                    high=FP32_MAX, holder="the fp32 router weights drawn with it"),
}
# fmt: on

# fmt: off
CRITERION_RANGES = {
    "moe_gate_loss_wt": Range("--moe-gate-loss-wt", False, "a finite number >= 0",
                              "use e.g. 0.01 (the default), or 0 to turn the balance loss off", low=0, high=FP32_MAX,
                              holder=FP32_LOSS),
    "moe_z_loss_wt": Range("--moe-z-loss-wt", False, "a finite number >= 0",
                           "use 0 (the default) or a small weight such as 0.001", low=0, high=FP32_MAX,
                           holder=FP32_LOSS),
}
# fmt: on

# fmt: off
UPCYCLE_TOOL_RANGES = {
    "noise": Range("--noise", False, "a finite number >= 0", "use 0 (exact copies) or a small standard deviation "
                   "such as 0.001", low=0, high=FP32_MAX, holder="the fp32 noise added to the experts"),
    "router_std": Range("--router-std", False, "a finite number >= 0", "use 0 (a zero router) or a small standard "
                        "deviation such as 0.01", low=0, high=FP32_MAX, holder="the fp32 router weights drawn with it"),
    "seed": Range("--seed", True, "an integer >= 0", "use e.g. 1 (the default)", low=0, high=2 ** 64 - 1,
                  holder="torch's random generator"),
}
# fmt: on


def check_option(spec: Range, value, **fix_fields) -> None:
    """One line naming ``spec.flag``, the problem and the fix, if ``value`` is outside ``spec``."""
    if value is None and spec.optional:
        return
    fix = spec.fix.format(**fix_fields)
    wrong = MoEOptionError(f"{spec.flag} must be {spec.requirement}, got {value!r}: {fix}")
    wanted = (int,) if spec.integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, wanted):
        raise wrong
    try:
        if not spec.integer and not math.isfinite(float(value)):
            raise wrong
    except OverflowError:  # an integer beyond every float
        raise wrong from None
    if spec.low is not None and (value < spec.low or (spec.low_open and value == spec.low)):
        raise wrong
    if spec.high is not None and abs(value) > spec.high:
        limit = f"{spec.high:g}" if isinstance(spec.high, float) else str(spec.high)
        raise MoEOptionError(f"{spec.flag} {value!r} is more than {spec.holder} can hold (at most {limit}): {fix}")
    if spec.smallest is not None and 0 < abs(value) < spec.smallest:
        raise MoEOptionError(
            f"{spec.flag} {value!r} is less than {spec.holder} can hold, which makes it 0 (the smallest "
            f"it holds is {spec.smallest:g}): {fix}"
        )


def check_options(ranges, read, **fix_fields) -> None:
    """``check_option`` for every row of ``ranges``, the value of option ``name`` being ``read(name)``."""
    for name, spec in ranges.items():
        check_option(spec, read(name), **fix_fields)
