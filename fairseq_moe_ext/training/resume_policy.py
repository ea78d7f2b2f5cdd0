"""Which options may change when a run resumes from its checkpoint, and which may not.

A checkpoint's weights were trained for one function: which experts a token reaches (the router,
top-k, gate normalisation) and what an expert computes (its activation). An option that keeps the
parameters but changes that function would silently train on a different model from weights made for
another one, and overwrite checkpoint_best and checkpoint_last with it. Options that only steer
training (capacity, gate noise, the balance losses' weights, the balance bias's rate), logging, or
how the workers are laid out and talk may change; each change is logged.

``POLICY`` decides every ``--moe-*`` option of the architectures and criterions (each option's record,
``options/``, says which rule and why), plus fairseq's ``--activation-fn``, which is the experts' activation:

* ``MAY_CHANGE``: the run resumes; the change is logged;
* ``CHANGES_FUNCTION``: refused in one line, unless ``--moe-allow-function-change`` is given, which
  logs a warning per option and resumes;
* ``CHANGES_PARAMETERS``: the model has other parameters or other shapes, so the checkpoint cannot be
  loaded at all: ``compat.check_resumable`` refuses it first, naming the flag; no override.

Torch only, like the rest of ``checkpoint/``; called by the Trainer.load_checkpoint path with the
checkpoint's cfg and this run's.
"""

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..options import SAVED_OPTIONS

# Re-exported: the kinds are written in the option records (options/record.py).
from ..options.record import CHANGES_FUNCTION, CHANGES_PARAMETERS, MAY_CHANGE, TRAINING_ONLY  # noqa: F401

logger = logging.getLogger(__name__)

OVERRIDE_FLAG = "--moe-allow-function-change"


@dataclass(frozen=True)
class Rule:
    kind: str
    why: str  # the reason, as docs/checkpoints.md's table and the messages say it
    section: str = "model"  # where the option lives in a checkpoint's cfg: "model" or "criterion"
    effective: Optional[Callable] = None  # (value, section) -> the value the run uses, where None means a default


# Each --moe-* option's rule is its record's (resume, why); fairseq's --activation-fn, which is the
# experts' activation, is fairseq's own option and has no record. The inference CLIs' flags are saved
# with no checkpoint, so no rule applies to them.
POLICY: Dict[str, Rule] = {o.name: Rule(o.resume, o.why, o.section, o.effective) for o in SAVED_OPTIONS}
POLICY["activation_fn"] = Rule(CHANGES_FUNCTION, "the activation of the experts and of the dense layers")

_ABSENT = object()


def check_resume_policy(path: str, saved_cfg, model_cfg, criterion_cfg, allow_function_change: bool) -> List[str]:
    """Refuse (one line) a resume of ``path`` whose options change what its weights compute, unless
    ``allow_function_change``; log every option that changed. ``saved_cfg``: the checkpoint's cfg
    (its "model" and "criterion" sections); ``model_cfg`` / ``criterion_cfg``: this run's. An option
    the checkpoint does not record (written before the option existed) is not compared. Returns the
    lines logged."""
    current = {"model": model_cfg, "criterion": criterion_cfg}
    logged = []
    for name, rule in POLICY.items():
        if rule.kind == CHANGES_PARAMETERS:
            continue  # compat.check_resumable, which knows the parameters, has refused it already
        saved_section, this_section = config_value(saved_cfg, rule.section, _ABSENT), current[rule.section]
        was, now = config_value(saved_section, name, _ABSENT), config_value(this_section, name, _ABSENT)
        if was is _ABSENT or now is _ABSENT:
            continue
        if rule.effective is not None:
            was, now = rule.effective(was, saved_section), rule.effective(now, this_section)
        if _same(was, now):
            continue
        flag = "--" + name.replace("_", "-")
        change = f"{path} was trained with {_spelled(flag, was)} and this run has {_spelled(flag, now)}"
        if rule.kind == CHANGES_FUNCTION and not allow_function_change:
            raise MoEOptionError(
                f"{change}, which {CHANGES_FUNCTION} ({rule.why}): {_resume_with(flag, was)}, or use a new "
                f"--save-dir, or add {OVERRIDE_FLAG} to train on from these weights with the new setting"
            )
        if rule.kind == CHANGES_FUNCTION:
            line = f"{OVERRIDE_FLAG}: {change}, which {CHANGES_FUNCTION} ({rule.why}); resuming with it as asked"
            logger.warning(line)
        else:
            line = f"resuming: {change} ({rule.why}; it may change on resume)"
            logger.info(line)
        logged.append(line)
    return logged


def _same(a, b) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return str(a) == str(b)


def _resume_with(flag: str, value) -> str:
    return f"resume without {flag}" if value is False else f"resume with {_spelled(flag, value)}"


def _spelled(flag: str, value) -> str:
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}" if value is not None else f"{flag} unset"
