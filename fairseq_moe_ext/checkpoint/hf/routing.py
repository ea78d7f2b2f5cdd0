"""The nllb routing options (second-expert policy, normalisation order, evaluation capacity as a token
fraction, batch-major queues) as Hugging Face ``NllbMoeConfig`` fields, and back.

NllbMoe (transformers 4.57.1, ``NllbMoeTop2Router.route_tokens``) routes as the nllb branch does:
tokens queue for capacity batch-major, evaluation keeps ``ceil(fraction * S)`` slots per expert (S
counting pads), the two gates are renormalised before or after dropping, and the second expert is
the best of the others, a Gumbel draw, or kept at random. This plugin's flags of the same meaning
(``--moe-second-expert-policy``, ``--moe-normalize-gate-after-dropping``,
``--moe-eval-capacity-token-fraction``, ``--moe-batch-major-routing``) map one to one, except where
the two disagree (docs/interop.md, "Where Hugging Face and the nllb branch disagree"): those
combinations are refused in one line. Torch-free.
"""

from typing import Dict, List, Tuple

from ...options import moe_options
from ..errors import CheckpointSetError

POLICIES = ("all", "sampling", "random")


def hf_value(config: dict, name: str, default=None):
    """A field of a Hugging Face ``config.json`` (NllbMoeConfig's own, though some share this plugin's option
    names), or ``default`` where it is absent or null."""
    value = config.get(name, default)
    return default if value is None else value


def _refuse(path, what, why, fix):
    raise CheckpointSetError(f"{path} has {what}: {why}; {fix} (nothing was written)")


def exported_routing(options, path: str) -> Tuple[Dict, List[str]]:
    """(NllbMoeConfig routing fields, NOTE lines) for a set's model ``options``."""
    values = moe_options(options)
    after = bool(values.moe_normalize_gate_after_dropping)
    if not (after or values.moe_normalize_gate):
        _refuse(
            path,
            "--moe-normalize-gate False",
            "NllbMoe always renormalises the two gates to sum to 1",
            "export a model trained with --moe-normalize-gate or --moe-normalize-gate-after-dropping",
        )
    policy = str(values.moe_second_expert_policy)
    if policy == "random" and not after:
        # HF then overwrites the normalised second gate with its raw probability (the combine weight too);
        # the branch, and this plugin, keep the normalised gate: another function.
        _refuse(
            path,
            "--moe-second-expert-policy random with gates normalised before dropping",
            "NllbMoe then weights the second expert by its raw probability, the nllb branch (and this "
            "plugin) by the normalised gate",
            "export a random-policy model trained with --moe-normalize-gate-after-dropping",
        )
    notes = []
    fraction = float(values.moe_eval_capacity_token_fraction or 0.0)
    factor = float(values.moe_eval_capacity_factor or 0.0)
    if fraction > 0:
        # Below 1 slots are dropped, and which depends on the queue order; at 1 or more none is.
        if fraction < 1 and not values.moe_batch_major_routing:
            _refuse(
                path,
                f"--moe-eval-capacity-token-fraction {fraction:g} without --moe-batch-major-routing",
                "NllbMoe queues tokens for capacity sentence by sentence (batch-major), so it would drop other "
                "slots than this model's time-major queues",
                "export a model with --moe-batch-major-routing",
            )
    elif factor != 0.0:
        _refuse(
            path,
            f"--moe-eval-capacity-factor {factor}",
            "NllbMoe's evaluation capacity is ceil(fraction * S) slots, which no fraction makes "
            "2*int(cf*ceil(S/E)) for every S",
            "export dropless evaluation (--moe-eval-capacity-factor 0) or "
            "the nllb branch's --moe-eval-capacity-token-fraction with --moe-batch-major-routing",
        )
    else:
        fraction = 1.0  # ceil(1.0 * S) slots: nothing is dropped, our dropless evaluation
    if policy != "all":
        notes.append(
            f"--moe-second-expert-policy {policy} -> second_expert_policy {policy}: drawn from torch's "
            f"generator in evaluation too, there as here"
        )
    fields = {
        "second_expert_policy": policy,
        "normalize_router_prob_before_dropping": not after,
        "moe_eval_capacity_token_fraction": fraction,
    }
    return fields, notes


def imported_routing(config: Dict, path: str) -> Tuple[Dict, List[str]]:
    """(this plugin's routing flags, NOTE lines) for an NllbMoe ``config`` (its defaults filled in)."""
    policy = str(config.get("second_expert_policy", "all"))
    if policy not in POLICIES:
        raise CheckpointSetError(
            f"{path}: second_expert_policy is {policy!r}, which NllbMoe's router does not define "
            f"({', '.join(POLICIES)}); fix config.json (nothing was written)"
        )
    before = bool(config.get("normalize_router_prob_before_dropping", False))
    if policy == "random" and before:
        raise CheckpointSetError(
            f"{path}: second_expert_policy 'random' with normalize_router_prob_before_dropping true weights the second "
            f"expert by its raw probability there (the nllb branch's gate is normalised), which this project cannot "
            f"represent; set normalize_router_prob_before_dropping false in config.json to import anyway "
            f"(nothing was written)"
        )
    flags = {
        "moe_second_expert_policy": policy,
        "moe_normalize_gate": True,
        "moe_normalize_gate_after_dropping": not before,
        "moe_batch_major_routing": True,
        "moe_eval_capacity_token_fraction": 0.0,
        "moe_eval_capacity_factor": 0.0,
    }
    notes = []
    fraction = float(hf_value(config, "moe_eval_capacity_token_fraction", 1.0))
    if 0 < fraction < 1:
        flags["moe_eval_capacity_token_fraction"] = fraction  # ceil(f * S), pads counted, as HF
    elif fraction <= 0:
        capacity = config.get("expert_capacity")
        if capacity is not None:
            raise CheckpointSetError(
                f"{path}: moe_eval_capacity_token_fraction is {fraction:g} with expert_capacity {capacity}: NllbMoe "
                f"then evaluates with a fixed {capacity} slots per expert whatever the batch, which this project "
                f"cannot represent; set expert_capacity null (2*ceil(S/E)) or a fraction > 0 in config.json to import "
                f"anyway (nothing was written)"
            )
        flags["moe_eval_capacity_factor"] = 1.0
        notes.append(
            "moe_eval_capacity_token_fraction <= 0 with expert_capacity null: NllbMoe evaluates with "
            "2*ceil(S/E) slots of its first batch and keeps that count; here every batch gets 2*ceil(S/E) "
            "(--moe-eval-capacity-factor 1, S without pads), as the nllb branch does"
        )
    # fraction >= 1: ceil(f * S) >= S slots drop nothing, which is dropless evaluation here
    if policy != "all":
        notes.append(
            f"second_expert_policy {policy} -> --moe-second-expert-policy {policy}: the second expert is "
            f"drawn in evaluation too, as there: outputs differ from run to run unless torch is seeded"
        )
    return flags, notes
