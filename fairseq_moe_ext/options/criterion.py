"""The MoE criterions' options (``moe_label_smoothed_cross_entropy``, ``moe_cross_entropy``): one
record each, as the architectures' (``record.Option``); they live in a checkpoint's cfg "criterion"
section, and only steer training and logging."""

from .record import CRITERION, FP32_LOSS, FP32_MAX, MAY_CHANGE, TRAINING_ONLY, Option, within

COMBINE_METHODS = ("average", "sum")
LOSS_WEIGHT = "a loss weight; " + TRAINING_ONLY

# fmt: off
CRITERION_OPTIONS = (
    Option("moe_gate_loss_wt", float, 0.01, "weight of the balance loss (1.0 balanced, E collapsed) (default 0.01)",
           MAY_CHANGE, LOSS_WEIGHT, where=CRITERION,
           range=within(False, "a finite number >= 0", "use e.g. 0.01 (the default), or 0 to turn the balance loss "
                        "off", low=0, high=FP32_MAX, holder=FP32_LOSS)),
    Option("moe_z_loss_wt", float, 0.0, "weight of the router z-loss, mean logsumexp(logits)^2 (default 0)",
           MAY_CHANGE, LOSS_WEIGHT, where=CRITERION,
           range=within(False, "a finite number >= 0", "use 0 (the default) or a small weight such as 0.001", low=0,
                        high=FP32_MAX, holder=FP32_LOSS)),
    Option("moe_gate_loss_combine_method", str, "average",
           "combine the MoE layers' losses by 'average' or 'sum' (default average)",
           MAY_CHANGE, "how the layers' losses add up; " + TRAINING_ONLY, where=CRITERION, choices=COMBINE_METHODS),
    Option("moe_hide_expert_load", bool, False,
           "do not log every expert's share of token-slots per layer (moe_load_<layer>_e<i>); "
           "moe_imbalance (largest share x E, 1.0 = balanced) is logged either way",
           MAY_CHANGE, "logging only", where=CRITERION),
)
# fmt: on
