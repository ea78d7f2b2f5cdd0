"""What one option record holds (``Option``), and the ranges and resume kinds it is written with.

Torch only and fairseq-free, so every tier that derives a table from the records can import it:
``checkpoint/`` (the Hugging Face and nllb-branch names), ``models/`` and ``criterions/`` (the fairseq
dataclasses), ``options/ranges.py`` (the ranges), ``training/resume_policy.py`` (the resume rules).
"""

import enum
import functools
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Optional, Tuple

import torch

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError

FP32_MAX = float(torch.finfo(torch.float32).max)
FP32_SMALLEST = 2.0**-149  # the smallest positive fp32 (subnormal); below half of it fp32 holds 0
INT64_MAX = 2**63 - 1
TIMEDELTA_MAX_S = float(timedelta.max.days * 86400)  # whole days: total_seconds() of the max rounds past it
SIZE = "the int64 tensor sizes it becomes"
# The counts and sizes that become tensor shapes are bounded by the largest real models, with room (an int64 size
# holds far more: 10**9 experts fail in the allocator, 10**18 in torch's size arithmetic, each with a traceback).
MOST_EXPERTS = 2**20
EXPERTS_SIZED_FROM = "PEER's 1,048,576 experts per layer, the most of any published MoE"
WIDEST_FFN = 2**20
FFN_SIZED_FROM = "14 x PaLM's 73,728-wide FFN, the widest of a published model"
MOST_WORKERS = 2**20
WORKERS_SIZED_FROM = "10 x the largest training jobs run (some 100,000 GPUs)"
MOST_SYMBOLS = 2**20
SYMBOLS_SIZED_FROM = "4 x the largest vocabulary of a released model (NLLB-200's 256,206 symbols)"
FP32_LOSS = "the fp32 loss it multiplies"

# What a change of the option does when a run resumes (training/resume_policy.py).
MAY_CHANGE = "may change"
CHANGES_FUNCTION = "changes what the saved weights compute"
CHANGES_PARAMETERS = "changes the parameters"
RESUME_KINDS = (MAY_CHANGE, CHANGES_FUNCTION, CHANGES_PARAMETERS)
TRAINING_ONLY = "steers training only, not what the weights compute"

# Where an option is declared: every MoE architecture, the translation ones only, the criterions, or
# the inference CLIs; the first two live in a checkpoint's cfg "model" section, the criterions' in its
# "criterion" section, and the inference CLIs' flags in none (no checkpoint saves them).
EVERY_ARCH, TRANSLATION, CRITERION = "every architecture", "translation architectures", "criterions"
INFERENCE = "inference CLIs"
WHERE = (EVERY_ARCH, TRANSLATION, CRITERION, INFERENCE)


# fmt: off
@dataclass(frozen=True)
class Range:
    flag: str
    integer: bool
    requirement: str  # what a value must be, as the message says it: "a positive integer"
    fix: str  # may name {experts}: the run's --moe-expert-count
    low: Optional[float] = None  # the smallest value allowed, or the bound it must exceed (low_open)
    low_open: bool = False
    most: Optional[float] = None  # the largest value allowed (a weight's 1), said by the requirement
    high: Optional[float] = None  # the largest value what holds it can hold ...
    holder: str = ""  # ... and what holds it
    smallest: Optional[float] = None  # a nonzero value below this is 0 in the holder
    optional: bool = False  # None is allowed (the option then follows another one)
    sized_from: str = ""  # what ``high`` is sized from (the largest real model), said instead of the holder
# fmt: on


def within(integer: bool, requirement: str, fix: str, **bounds) -> Range:
    """A record's range; the record fills in its flag."""
    return Range("", integer, requirement, fix, **bounds)


# fmt: off
@dataclass(frozen=True)
class Option:
    """One option, declared once: every table that names it is derived from this record."""

    name: str  # the config field; the flag is --name-with-dashes
    type: Any  # int, float, bool, str, Optional[int], ...: the fairseq dataclass field's type
    default: Any
    help: str  # argparse's help, as docs/options.md shows it
    resume: str  # MAY_CHANGE, CHANGES_FUNCTION or CHANGES_PARAMETERS
    why: str  # the reason, as the resume messages and docs/checkpoints.md say it
    where: str = EVERY_ARCH
    choices: Tuple[str, ...] = ()  # a choice option's values (a fairseq ChoiceEnum)
    range: Optional[Range] = None  # a numeric option's range (options.ranges.check_option)
    field: Optional[str] = None  # the MoELayerConfig field it sets ("routing.k", "num_experts")
    to_field: Optional[Callable] = None  # (value, read) -> the field's value; read(name): another option's
    effective: Optional[Callable] = None  # (value, cfg section) -> the value a run uses, where None is a default
    launch_only: bool = False  # read from the command line when a run starts; architectures never set it
    hf: Optional[str] = None  # the NllbMoeConfig field carried over one to one (export-hf, import-hf)
    branch: Optional[str] = None  # the fairseq nllb/moe branch's option carried over one to one
    parse: Optional[Callable] = None  # (value as given or saved, flag) -> the value every reader gets
    # The values the combination matrix crosses with every layout and precision (tests/parallel/
    # test_combination_matrix.py), as the command line gives them: the option changes parameters, gradients or
    # routing. "{dense}" stands for a dense checkpoint the matrix writes; further words are flags it needs.
    matrix: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.range is not None and not self.range.flag:
            object.__setattr__(self, "range", replace(self.range, flag=self.flag))

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def value_type(self):
        """The type of a value given on the command line: ``int`` for ``Optional[int]``."""
        given = [kind for kind in getattr(self.type, "__args__", ()) if kind is not type(None)]
        return given[0] if given else self.type

    @property
    def section(self) -> str:
        """Where a checkpoint's cfg holds it: "model" or "criterion"."""
        return "criterion" if self.where == CRITERION else "model"

    def read(self, cfg, as_saved: bool = False):
        """This option's value in ``cfg`` (any config: Namespace, omegaconf, dict; its default where ``cfg``
        lacks it, or None with ``as_saved``: a checkpoint's config as it was written), as every reader gets it:
        parsed by the record's ``parse`` (``--moe-freeze``: a frozenset of parts), a choice as its ``StrEnum``
        member (equal to the string), a flag as a bool; numbers as given, so that their range check sees what
        the user passed."""
        raw = config_value(cfg, self.name, None if as_saved else self.default)
        if self.parse is not None:
            return self.parse(raw, self.flag)
        if raw is None:
            return None
        if self.choices:
            return choice_of(self, raw)
        if self.type is bool:
            return bool(raw)
        return raw

    def problems(self):
        """What the record lacks or gets wrong, one line each (an incomplete record is refused)."""
        found = []
        if not self.help.strip() or not self.why.strip():
            found.append(f"{self.name}: every record says what it does (help) and why it may change or not (why)")
        if self.resume not in RESUME_KINDS:
            found.append(f"{self.name}: resume must be one of {RESUME_KINDS}, not {self.resume!r}")
        if self.where not in WHERE:
            found.append(f"{self.name}: where must be one of {WHERE}, not {self.where!r}")
        if self.choices and self.default not in self.choices:
            found.append(f"{self.name}: the default {self.default!r} is not one of its choices {self.choices}")
        if self.choices and any(value not in self.choices for value in self.matrix):
            found.append(f"{self.name}: the matrix values {self.matrix} are not all among its choices {self.choices}")
        if self.to_field is not None and self.field is None:
            found.append(f"{self.name}: to_field without the field it converts to")
        if self.where in (CRITERION, INFERENCE) and (self.field or self.hf or self.branch):
            found.append(f"{self.name}: a criterion or inference option sets no layer field and has no checkpoint name")
        return found
# fmt: on


@functools.lru_cache(maxsize=None)
def choice_type(name: str, choices: Tuple[str, ...]) -> type:
    """The ``StrEnum`` of an option's choices: its members compare and print as the strings they stand for."""
    title = "".join(part.title() for part in name.split("_"))
    return enum.StrEnum(title, {choice.upper().replace("-", "_"): choice for choice in choices})


def choice_of(option: Option, raw):
    """``raw`` (a string, a ChoiceEnum member of fairseq's dataclass, an earlier member) as its member."""
    kind = choice_type(option.name, option.choices)
    try:
        return kind(str(raw))
    except ValueError:
        raise MoEOptionError(
            f"{option.flag} {raw}: not one of its choices; use one of {', '.join(option.choices)}"
        ) from None
