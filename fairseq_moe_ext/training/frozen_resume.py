"""A resume whose ``--moe-freeze`` differs from the checkpoint's: the optimizer state is carried over per
parameter.

fairseq builds its optimizer from the parameters that want a gradient, in the model's order, and saves its
state by position in that list; torch's ``load_state_dict`` refuses a state of another length. Freezing may
change on resume (``resume_policy.POLICY``), so the saved state is rewritten for this run's list before
fairseq loads it: a parameter that trained before and trains now keeps its state (Adam's moments, say), one
that starts training starts from none, one that stops training drops its state. The learning-rate schedule,
the update count and the rest of the optimizer's saved fields are kept. Torch only: plain dicts in, plain
dicts out.
"""

import logging
from typing import Optional

import torch.nn as nn

from ..common.config_value import config_value
from ..moe.freeze import part_of, router_parameter_ids
from ..options import moe_options

logger = logging.getLogger(__name__)


def remap_optimizer_state(optim_state: dict, was_trained, now_trained) -> Optional[dict]:
    """``optim_state``: a torch optimizer's state dict over the parameters whose ``was_trained`` flag (one per
    parameter of the model, in order) is True; returns it over those whose ``now_trained`` flag is, or None
    where its layout is not one group over exactly those parameters."""
    groups = optim_state.get("param_groups")
    saved_count = sum(bool(w) for w in was_trained)
    if not isinstance(groups, list) or len(groups) != 1 or len(groups[0].get("params", ())) != saved_count:
        return None
    saved_ids = list(groups[0]["params"])
    saved_at, index = {}, 0
    for position, trained in enumerate(was_trained):
        if trained:
            saved_at[position] = saved_ids[index]
            index += 1
    state, kept, new_state, count = optim_state.get("state", {}), 0, {}, 0
    for position, trained in enumerate(now_trained):
        if not trained:
            continue
        if position in saved_at and saved_at[position] in state:
            new_state[count] = state[saved_at[position]]
            kept += 1
        count += 1
    remapped = dict(optim_state, state=new_state, param_groups=[dict(groups[0], params=list(range(count)))])
    remapped["_kept"] = kept
    return remapped


def carry_optimizer_state_over_freeze(path: str, state: dict, model: nn.Module, model_cfg) -> Optional[str]:
    """Rewrite ``state["last_optimizer_state"]`` (a loaded checkpoint) for this run's ``--moe-freeze`` when the
    checkpoint's differs; returns the line logged, or None when nothing changed."""
    saved_cfg = config_value(state.get("cfg"), "model", None)
    was = moe_options(saved_cfg).moe_freeze
    now = moe_options(model_cfg).moe_freeze
    optim_state = state.get("last_optimizer_state")
    if was == now or not isinstance(optim_state, dict):
        return None
    router_ids = router_parameter_ids(model)
    parts = [part_of(p, router_ids) for p in model.parameters()]
    remapped = remap_optimizer_state(optim_state, [p not in was for p in parts], [p not in now for p in parts])
    if remapped is None:
        remapped = dict(optim_state, state={})
        groups = optim_state.get("param_groups") or [{}]
        remapped["param_groups"] = [dict(groups[0], params=list(range(sum(p not in now for p in parts))))]
        kept = "none of its per-parameter state (its layout is not one group over the trained parameters)"
    else:
        kept = f"the state of the {remapped.pop('_kept')} tensors that trained before and train now"
    state["last_optimizer_state"] = remapped
    spell = lambda parts_: ",".join(sorted(parts_)) or "nothing"  # noqa: E731
    line = (
        f"resuming: {path} was trained with {spell(was)} frozen and this run freezes {spell(now)}: the optimizer "
        f"keeps {kept}; the others start afresh"
    )
    logger.info(line)
    return line
