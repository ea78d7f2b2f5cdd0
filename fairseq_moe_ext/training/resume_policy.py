"""Which options may change when a run resumes from its checkpoint, and which may not.

A checkpoint's weights were trained for one function: which experts a token reaches (the router,
top-k, gate normalisation) and what an expert computes (its activation). An option that keeps the
parameters but changes that function would silently train on a different model from weights made for
another one, and overwrite checkpoint_best and checkpoint_last with it. Options that only steer
training (capacity, gate noise, the balance losses' weights, the balance bias's rate), logging, or
how the workers are laid out and talk may change; each change is logged.

``POLICY`` decides every ``--moe-*`` option of the architectures and criterions (a test checks that
none is missing), plus fairseq's ``--activation-fn``, which is the experts' activation:

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

from ..checkpoint.config_value import config_value
from ..moe.balance_bias import DEFAULT_BIAS_UPDATE_RATE
from ..moe.refusal import MoEOptionError

logger = logging.getLogger(__name__)

MAY_CHANGE = "may change"
CHANGES_FUNCTION = "changes what the saved weights compute"
CHANGES_PARAMETERS = "changes the parameters"
OVERRIDE_FLAG = "--moe-allow-function-change"


@dataclass(frozen=True)
class Rule:
    kind: str
    why: str  # the reason, as docs/checkpoints.md's table and the messages say it
    section: str = "model"  # where the option lives in a checkpoint's cfg: "model" or "criterion"
    effective: Optional[Callable] = None  # (value, section) -> the value the run uses, where None means a default


def _bias_rate(value, model_cfg):
    return DEFAULT_BIAS_UPDATE_RATE if value is None else value


TRAINING_ONLY = "steers training only, not what the weights compute"

# fmt: off
POLICY: Dict[str, Rule] = {
    # which experts a token reaches, and what they compute
    "moe_router": Rule(CHANGES_FUNCTION, "top and sigmoid score the experts differently from the same weights; "
                                         "cosine has other parameters"),
    "moe_top_k": Rule(CHANGES_FUNCTION, "a token is sent to another number of experts"),
    "moe_normalize_gate": Rule(CHANGES_FUNCTION, "the gates a token's expert outputs are weighted with"),
    "moe_eom": Rule(CHANGES_FUNCTION, "inference multiplies every expert output by 1 - p"),
    "moe_second_expert_policy": Rule(CHANGES_FUNCTION, "which second expert a token reaches, drawn at random or not"),
    "moe_normalize_gate_after_dropping": Rule(CHANGES_FUNCTION, "the gates of tokens that lost a slot"),
    "activation_fn": Rule(CHANGES_FUNCTION, "the activation of the experts and of the dense layers"),
    # other parameters: compat.check_resumable refuses them by parameter shapes and names
    "moe_expert_count": Rule(CHANGES_PARAMETERS, "another number of experts and router rows"),
    "moe_freq": Rule(CHANGES_PARAMETERS, "other layers are MoE"),
    "encoder_moe_freq": Rule(CHANGES_PARAMETERS, "other encoder layers are MoE"),
    "decoder_moe_freq": Rule(CHANGES_PARAMETERS, "other decoder layers are MoE"),
    "moe_expert_ffn_dim": Rule(CHANGES_PARAMETERS, "experts of another hidden size"),
    "moe_shared_expert_count": Rule(CHANGES_PARAMETERS, "another number of shared experts"),
    "moe_shared_expert_ffn_dim": Rule(CHANGES_PARAMETERS, "shared experts of another hidden size"),
    "moe_balance": Rule(CHANGES_PARAMETERS, "the balance bias is a saved buffer of its own"),
    # training, inference-time, precision, layout, communication, logging
    "moe_capacity_factor": Rule(MAY_CHANGE, "which slots training drops; " + TRAINING_ONLY),
    "moe_eval_capacity_factor": Rule(MAY_CHANGE, "validation and inference routing capacity, a choice of each run"),
    "moe_batch_prioritized_routing": Rule(MAY_CHANGE, "which slots are dropped when a capacity is reached"),
    "moe_batch_major_routing": Rule(MAY_CHANGE, "which slots are dropped when a capacity is reached"),
    "moe_eval_capacity_token_fraction": Rule(MAY_CHANGE, "validation and inference routing capacity, a choice of "
                                                         "each run"),
    "moe_gate_noise": Rule(MAY_CHANGE, "exploration noise in training; " + TRAINING_ONLY),
    "moe_normalize_expert_grad": Rule(MAY_CHANGE, "the expert gradients' scale, like a learning rate on experts; "
                                                  + TRAINING_ONLY),
    "moe_bias_update_rate": Rule(MAY_CHANGE, "how fast the bias moves from now on, like a learning rate",
                                 effective=_bias_rate),
    "moe_gating_no_fp32": Rule(MAY_CHANGE, "the router's precision, not its function"),
    "moe_gating_use_fp32": Rule(MAY_CHANGE, "accepted for fairseq's moe branch; no effect"),
    "moe_expert_parallel_size": Rule(MAY_CHANGE, "experts are resharded at load"),
    "moe_comm_timeout": Rule(MAY_CHANGE, "how long a collective waits for a stalled peer"),
    "moe_deterministic": Rule(MAY_CHANGE, "reproducibility of the kernels, not the function"),
    "moe_restore_fallback": Rule(MAY_CHANGE, "which checkpoint a damaged one falls back to"),
    "moe_allow_function_change": Rule(MAY_CHANGE, "this check's own override"),
    "moe_upcycle_from": Rule(MAY_CHANGE, "used only by a run's first launch"),
    "moe_upcycle_noise": Rule(MAY_CHANGE, "used only by a run's first launch"),
    "moe_upcycle_router_std": Rule(MAY_CHANGE, "used only by a run's first launch"),
    "moe_gate_loss_wt": Rule(MAY_CHANGE, "a loss weight; " + TRAINING_ONLY, section="criterion"),
    "moe_z_loss_wt": Rule(MAY_CHANGE, "a loss weight; " + TRAINING_ONLY, section="criterion"),
    "moe_gate_loss_combine_method": Rule(MAY_CHANGE, "how the layers' losses add up; " + TRAINING_ONLY,
                                         section="criterion"),
    "moe_hide_expert_load": Rule(MAY_CHANGE, "logging only", section="criterion"),
}
# fmt: on

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
