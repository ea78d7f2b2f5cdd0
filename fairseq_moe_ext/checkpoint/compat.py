"""Can this checkpoint resume this model? One line naming the flag to change, instead of torch's page
of size mismatches, when a run is resumed with other flags than it was trained with."""

from typing import Dict, Tuple

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..moe.experts import is_expert
from ..options import moe_options
from ..options.sides import sides_of


def check_resumable(path: str, state: Dict, model, world_size: int, model_cfg) -> None:
    """``state``: the checkpoint already sliced for one of ``world_size`` workers; ``model``: that
    worker's model; ``model_cfg``: its options."""
    params = dict(model.named_parameters())
    mismatched = [k for k, t in state["model"].items() if k in params and tuple(params[k].shape) != tuple(t.shape)]
    for key in mismatched:  # expert counts first: they also change every router's shape
        tensor, param = state["model"][key], params[key]
        if is_expert(param) and tensor.shape[1:] == param.shape[1:]:
            side = key.split(".", 1)[0]  # a side with a count of its own (a pruned set's) is named by its flag
            saved = config_value(state.get("cfg"), "model")
            own = any(config_value(c, f"{side}_moe_expert_count") is not None for c in (saved, model_cfg))
            flag = f"--{side}-moe-expert-count" if own else "--moe-expert-count"
            raise MoEOptionError(
                f"{path} holds {tensor.shape[0] * world_size} experts in {key.rsplit('.experts', 1)[0]}, this model "
                f"{param.shape[0] * world_size}: resume with the checkpoint's {flag}, or use a new --save-dir"
            )
    if mismatched:
        key = mismatched[0]
        raise MoEOptionError(
            f"{path} does not fit this model: {key} is {tuple(state['model'][key].shape)} there and "
            f"{tuple(params[key].shape)} here; resume with the architecture flags the checkpoint was trained "
            f"with, or use a new --save-dir"
        )
    if set(state["model"]) == set(model.state_dict()):
        return
    # Other parameters (not other shapes): name the flag that differs, if one of ours does. Without
    # such a flag, fairseq's own error (after its upgrades of old key names) stands.
    saved = layout_flags(config_value(state.get("cfg"), "model"))
    current = layout_flags(model_cfg)
    for what, (given, value) in saved.items():
        this_flag, this_value = current[what]
        if value is not None and this_value is not None and str(value) != str(this_value):
            raise MoEOptionError(
                f"{path} was trained with {given} {value} and this run has {this_flag} {this_value}, which gives "
                f"the model other parameters: resume with {this_flag} {value}, or use a new --save-dir"
            )


def layout_flags(cfg) -> Dict[str, Tuple[str, object]]:
    """The flags that decide which parameters an MoE model has (beyond their shapes):
    {what: (flag as the user would pass it, value)}."""
    flags = {
        "router": ("--moe-router", moe_options(cfg).moe_router),
        "shared experts": ("--moe-shared-expert-count", moe_options(cfg).moe_shared_expert_count),
        "balance": ("--moe-balance", moe_options(cfg).moe_balance),
    }
    for side in sides_of(cfg):
        flags[f"{side.name} freq"] = (side.freq_option, side.moe_freq)
        flags[f"{side.name} layers"] = (f"--{side.name}-layers", config_value(cfg, f"{side.name}_layers"))
    return flags
