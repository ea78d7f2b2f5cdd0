"""The MoE criterions' options (``moe_label_smoothed_cross_entropy``, ``moe_cross_entropy``), and those of
the distillation criterion (``moe_distillation``, which takes both): one record each, as the architectures'
(``record.Option``); they live in a checkpoint's cfg "criterion" section, and only steer training and
logging (a teacher is never saved with its student: a resume reads it again from --distill-teacher)."""

from typing import Optional

from .record import (
    CRITERION,
    FP32_LOSS,
    FP32_MAX,
    MAY_CHANGE,
    MOST_SYMBOLS,
    SYMBOLS_SIZED_FROM,
    TRAINING_ONLY,
    Option,
    within,
)

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

# How the teacher's experts are held on N > 1 training workers (as --moe-inference-experts in generation), and
# the dtype it runs in ("student": the training run's --fp16 / --bf16, else float32).
TEACHER_PLACEMENTS = ("auto", "sharded", "local")
TEACHER_DTYPES = ("student", "float32", "float16", "bfloat16")
TEACHER = "which teacher, and how it runs; " + TRAINING_ONLY + " (the teacher is read again at each launch)"

# fmt: off
DISTILL_OPTIONS = (
    Option("distill_teacher", Optional[str], None,
           "the teacher's checkpoint: any set or file this plugin loads (per-rank set, merged, imported, pruned; "
           "MoE or dense), of this task and these dictionaries; run in eval mode without gradients, never saved "
           "into the student's checkpoint (a resume reads it again from here)",
           MAY_CHANGE, TEACHER, where=CRITERION),
    Option("distill_weight", float, 0.5,
           "weight of the teacher's term: loss = (1 - w) * label-smoothed cross-entropy + w * T^2 * KL(teacher || "
           "student) at temperature T, summed over target tokens (default 0.5)",
           MAY_CHANGE, LOSS_WEIGHT, where=CRITERION,
           range=within(False, "a number between 0 and 1", "use e.g. 0.5 (the default), 0 for the labels only or "
                        "1 for the teacher only", low=0, most=1)),
    Option("distill_temperature", float, 1.0,
           "temperature T both distributions are softened by in the teacher's term (default 1)",
           MAY_CHANGE, LOSS_WEIGHT, where=CRITERION,
           range=within(False, "a finite number > 0", "use e.g. 1 (the default) or 2", low=0, low_open=True,
                        high=FP32_MAX, holder="the fp32 logits it divides")),
    Option("distill_top_k", int, 0,
           "keep only the teacher's K most probable tokens per target position, renormalised (memory: K instead of "
           "the vocabulary per token); 0: the whole vocabulary (default 0)",
           MAY_CHANGE, LOSS_WEIGHT, where=CRITERION,
           range=within(True, "an integer >= 0", "use 0 (the whole vocabulary) or e.g. 8", low=0, high=MOST_SYMBOLS,
                        sized_from=SYMBOLS_SIZED_FROM)),
    Option("distill_teacher_dtype", str, "student",
           "the dtype the teacher runs in: 'student' (default: the run's --fp16 / --bf16, else float32), or "
           "float32, float16, bfloat16 whatever the student's",
           MAY_CHANGE, TEACHER, where=CRITERION, choices=TEACHER_DTYPES),
    Option("distill_teacher_experts", str, "auto",
           "a teacher with MoE layers, on N > 1 workers: 'sharded' spreads its experts over the workers (as sharded "
           "generation; every worker joins every MoE call), 'local' gives every worker every expert; 'auto' "
           "(default) is sharded when the teacher's set was saved by N workers, else local",
           MAY_CHANGE, TEACHER, where=CRITERION, choices=TEACHER_PLACEMENTS),
)
# fmt: on
