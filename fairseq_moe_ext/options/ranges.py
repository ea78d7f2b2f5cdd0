"""Every numeric option of the plugin, checked at start-up against the range of what it is used in.

A type check lets through values that fail much later: ``--moe-bias-update-rate 1e39`` is a float,
but the balance bias it moves is fp32 and dies at the first update ("value cannot be converted to
type float without overflow"); ``--moe-comm-timeout 1e39`` overflows the timedelta the expert groups
are made with. Each row below says what the option must be (finite, positive where it must be), and
where its value ends up, the largest value that holds it (fp32 for what is added to fp32 tensors,
int64 for what becomes a tensor size, a timedelta for seconds) and, where a tiny value would round
to 0 there, the smallest. ``check_option`` turns a value outside its row into one line naming the
flag, the problem and the fix. Torch only; the models, the criterions and the checkpoint tool's
``upcycle`` call it (``MODEL_RANGES``, ``CRITERION_RANGES``, ``UPCYCLE_TOOL_RANGES``), and ``plan``
(``PLAN_TOOL_RANGES``) and the checkpoint tool's other subcommands (``CHECKPOINT_TOOL_RANGES``). The rows of the
``--moe-*`` options are their records' ``range`` (``options/``); the tools' own flags are written here. A tool's
count that nothing holds but the work it causes (the workers plan lays out, the symbols of a dictionary) is
bounded by what the largest real models use, with room (``sized_from``).

Not here, because any finite value works: the capacity factors (a factor beyond the expert count
serves every slot, and ``moe/capacity.py`` caps it there) and the MoE layer frequencies (Python
integers; one that places no MoE layer is refused by ``check_moe_layers_placed``).
"""

import math

from ..common.refusal import MoEOptionError

# Re-exported: the records are written with these (options/record.py), and callers import them here.
from . import CRITERION_OPTIONS, DISTILL_OPTIONS, MODEL_OPTIONS
from .record import (  # noqa: F401
    FP32_LOSS,
    FP32_MAX,
    FP32_SMALLEST,
    INT64_MAX,
    MOST_SYMBOLS,
    MOST_WORKERS,
    SIZE,
    SYMBOLS_SIZED_FROM,
    TIMEDELTA_MAX_S,
    WORKERS_SIZED_FROM,
    Range,
)

# Each option's range is its record's (options/model.py, run.py, criterion.py).
MODEL_RANGES = {o.name: o.range for o in MODEL_OPTIONS if o.range is not None}
CRITERION_RANGES = {o.name: o.range for o in CRITERION_OPTIONS if o.range is not None}
DISTILL_RANGES = {o.name: o.range for o in DISTILL_OPTIONS if o.range is not None}

# Workers and symbols: the records' bounds (record.MOST_WORKERS, MOST_SYMBOLS: 4 x the largest vocabulary of a
# released model, NLLB-200's 256,206; Gemma's 256,000); bytes of one device: 4 x the largest accelerator's (288 GB).
LARGEST_WORLD, LARGEST_VOCABULARY, LARGEST_DEVICE = MOST_WORKERS, MOST_SYMBOLS, 2**40
WORLD_SIZED_FROM = WORKERS_SIZED_FROM

# fmt: off
PLAN_TOOL_RANGES = {
    "world_size": Range("--world-size", True, "a positive integer", "give the number of GPUs (workers) to plan for, "
                        "e.g. --world-size 8", low=1, high=LARGEST_WORLD, sized_from=WORLD_SIZED_FROM),
    "dictionary_size": Range("--dictionary-size", True, "an integer >= 5 (fairseq's 4 special symbols and a word)",
                             "give the dictionary's size: the lines of the dict.txt fairseq-train will read, plus 4",
                             low=5, high=LARGEST_VOCABULARY, optional=True,
                             sized_from=SYMBOLS_SIZED_FROM),
}
CHECKPOINT_TOOL_RANGES = {  # every subcommand's that has them (python -m fairseq_moe_ext.checkpoint)
    "world_size": Range("--world-size", True, "a positive number of workers", "use the number of workers that will "
                        "resume from the set", low=1, high=LARGEST_WORLD, sized_from=WORLD_SIZED_FROM, optional=True),
    # No lower bound here: a P below 1 gets the line that lists the P that divide (__main__.expert_parallel_size).
    "expert_parallel_size": Range("--expert-parallel-size", True, "an integer", "use a P dividing both --world-size "
                                  "and the experts, or drop it for the default", high=LARGEST_WORLD,
                                  sized_from=WORLD_SIZED_FROM, optional=True),
}
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
    if spec.most is not None and value > spec.most:
        raise wrong
    if spec.high is not None and abs(value) > spec.high:
        limit = f"{spec.high:g}" if isinstance(spec.high, float) else str(spec.high)
        if spec.sized_from:
            raise MoEOptionError(f"{spec.flag} {value!r} is beyond {spec.sized_from} (at most {limit}): {fix}")
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
