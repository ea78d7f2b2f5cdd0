"""The MoE architectures' options that shape the model and its routing: one record each.

A record here is the whole option (``record.Option``); the fairseq dataclass, the ranges, the resume
policy, the MoE layer's config, the Hugging Face and nllb-branch names and docs/options.md are read
from it. The options that steer a run rather than the model (communication, restore, upcycling) are in
``run.py``.
"""

from typing import Optional

from ..moe.balance_bias import DEFAULT_BIAS_UPDATE_RATE
from ..moe.freeze import FREEZABLE_PARTS, parse_frozen_parts
from ..moe.layer_config import BALANCE_SCOPES, ROUTER_TYPES
from ..moe.scorers import SCORERS
from ..moe.second_expert import SECOND_EXPERT_POLICIES
from .record import (
    CHANGES_FUNCTION,
    CHANGES_PARAMETERS,
    EXPERTS_SIZED_FROM,
    FFN_SIZED_FROM,
    FP32_MAX,
    FP32_SMALLEST,
    MAY_CHANGE,
    MOST_EXPERTS,
    MOST_WORKERS,
    TRAINING_ONLY,
    TRANSLATION,
    WIDEST_FFN,
    WORKERS_SIZED_FROM,
    Option,
    within,
)

EXPERT_GRAD_NORMALIZATIONS = ("world_size", "sqrt_world_size")  # parallel.plan.ParallelPlan.expert_grad_factor
BALANCE_CHOICES = ("none", "bias")
FREQ_FIX = "use N for an MoE layer every N layers, or 0 for none"
CAPACITY_FIX = "use 0 for dropless routing, > 0 for a fixed capacity, < 0 for a bounded dropless one"
ROUTING_CAPACITY = "validation and inference routing capacity, a choice of each run"
DROPPED_SLOTS = "which slots are dropped when a capacity is reached"
SIDE_EXPERTS_FIX = "use 1 or more experts, or drop it for --moe-expert-count"


def bias_rate(value, read):
    """--moe-bias-update-rate as the layer's balance_bias_rate: None without --moe-balance bias."""
    if str(read("moe_balance")) != "bias":
        return None
    return DEFAULT_BIAS_UPDATE_RATE if value is None else float(value)


def effective_bias_rate(value, section):
    return DEFAULT_BIAS_UPDATE_RATE if value is None else value


def router_choices() -> str:
    """--moe-router's types, each with its scorer's summary (moe/scorers.py): "'top' (...) or 'sigmoid' (...)"."""
    named = [f"'{name}' ({scorer.summary})" for name, scorer in SCORERS.items()]
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]


def frozen_parts(value, section):
    """--moe-freeze in one spelling (``experts,router`` is ``router,experts``); None: nothing frozen."""
    parts = parse_frozen_parts(value, "--moe-freeze")
    return ",".join(part for part in FREEZABLE_PARTS if part in parts) or None


# fmt: off
MODEL_OPTIONS = (
    Option("moe_expert_count", int, 8,
           "number of experts in each MoE layer, over all workers (default 8)",
           CHANGES_PARAMETERS, "another number of experts and router rows",
           range=within(True, "a positive integer", "use 1 or more experts", low=1, high=MOST_EXPERTS,
                        sized_from=EXPERTS_SIZED_FROM),
           field="num_experts", hf="num_experts", branch="moe_expert_count"),
    Option("moe_expert_parallel_size", Optional[int], None,
           "expert-parallel size P: each group of P consecutive workers holds every expert once "
           "(E/P per worker, tokens reach them by all-to-all within the group) and the W/P groups are "
           "replicas whose expert gradients are summed; must divide both the number of workers and "
           "--moe-expert-count (each side's, with --encoder/--decoder-moe-expert-count). Larger P: less "
           "expert memory per worker, all-to-alls over more workers (keep a group within a node) "
           "(default: the largest such P, gcd(workers, experts of each side))",
           MAY_CHANGE, "experts are resharded at load",
           range=within(True, "a positive integer", "use a P dividing both the number of workers and "
                        "--moe-expert-count, or drop it for the default (the largest such P)", low=1,
                        high=MOST_WORKERS, sized_from=WORKERS_SIZED_FROM, optional=True)),
    Option("moe_normalize_expert_grad", str, "world_size",
           "world_size: expert gradients equal the one-process gradient, as shared ones do; "
           "sqrt_world_size (the nllb branch's option): sqrt(P) times it, P the expert-parallel size, "
           "before clipping, like a sqrt(P) larger learning rate on experts; no change on one worker "
           "(default world_size)",
           MAY_CHANGE, "the expert gradients' scale, like a learning rate on experts; " + TRAINING_ONLY,
           choices=EXPERT_GRAD_NORMALIZATIONS),
    Option("moe_freq", int, 2,
           "layer i (0-based) is an MoE layer when (i + 1) % freq == 0; 0: no MoE layer on that "
           "side; the model needs at least one MoE layer (default 2: every other layer)",
           CHANGES_PARAMETERS, "other layers are MoE", range=within(True, "an integer >= 0", FREQ_FIX, low=0)),
    Option("decoder_moe_freq", Optional[int], None, "--moe-freq for decoder layers (default: --moe-freq)",
           CHANGES_PARAMETERS, "other decoder layers are MoE",
           range=within(True, "an integer >= 0", FREQ_FIX, low=0, optional=True)),
    Option("decoder_moe_expert_count", Optional[int], None,
           "--moe-expert-count for decoder MoE layers (default: --moe-expert-count); a set pruned with "
           "prune --encoder-decoder-ratio keeps another number of experts on each side",
           CHANGES_PARAMETERS, "another number of decoder experts and router rows",
           range=within(True, "a positive integer", SIDE_EXPERTS_FIX, low=1, high=MOST_EXPERTS,
                        sized_from=EXPERTS_SIZED_FROM, optional=True)),
    Option("moe_top_k", int, 2, "experts per token (default 2)",
           CHANGES_FUNCTION, "a token is sent to another number of experts",
           range=within(True, "an integer >= 1", "use 1 <= --moe-top-k <= {experts}", low=1, high=MOST_EXPERTS,
                        sized_from=EXPERTS_SIZED_FROM),
           field="routing.k"),
    Option("moe_capacity_factor", float, 0.0,
           "training capacity, Tutel semantics with N tokens over all workers: > 0 keeps "
           "k*int(cf*ceil(N/E)) slots per expert and drops the rest; 0 is dropless; < 0 is "
           "dropless up to k*int(|cf|*ceil(N/E)) (default 0)",
           MAY_CHANGE, "which slots training drops; " + TRAINING_ONLY,
           range=within(False, "a finite number", CAPACITY_FIX), field="capacity_factor"),
    Option("moe_eval_capacity_factor", float, 0.0,
           "capacity factor in validation and inference (default 0: dropless, so outputs "
           "do not depend on batch composition)",
           MAY_CHANGE, ROUTING_CAPACITY, range=within(False, "a finite number", CAPACITY_FIX),
           field="eval_capacity_factor"),
    Option("moe_gate_noise", float, 0.0,
           "std of Gaussian noise (divided by E) added to router logits when choosing "
           "experts in training only (default 0)",
           MAY_CHANGE, "exploration noise in training; " + TRAINING_ONLY,
           range=within(False, "a finite number >= 0", "use 0 (no noise) or a standard deviation > 0", low=0,
                        high=FP32_MAX, holder="the fp32 router scores it is added to"),
           field="routing.gate_noise"),
    Option("moe_gating_use_fp32", bool, False,
           "accepted for compatibility with fairseq's moe branch: routing already runs in "
           "fp32 unless --moe-gating-no-fp32",
           MAY_CHANGE, "accepted for fairseq's moe branch; no effect"),
    Option("moe_gating_no_fp32", bool, False, "run the router in the activation dtype instead of fp32",
           MAY_CHANGE, "the router's precision, not its function",
           field="routing.fp32", to_field=lambda value, read: not value),
    Option("moe_router", str, "top",
           f"router: {router_choices()} (default top)",
           CHANGES_FUNCTION, "top and sigmoid score the experts differently from the same weights; "
                             "cosine has other parameters",
           choices=tuple(ROUTER_TYPES), field="routing.router_type"),
    Option("moe_shared_expert_count", int, 0,
           "shared experts (DeepSeek-MoE) per MoE layer: always active, run as one dense FFN beside "
           "the routed experts and added to their output; replicated like shared parameters (default 0)",
           CHANGES_PARAMETERS, "another number of shared experts",
           range=within(True, "an integer >= 0", "use 0 for no shared experts", low=0, high=MOST_EXPERTS,
                        sized_from=EXPERTS_SIZED_FROM),
           field="shared_expert_count"),
    Option("moe_shared_expert_ffn_dim", Optional[int], None,
           "hidden size of each shared expert (default: the routed experts' hidden size)",
           CHANGES_PARAMETERS, "shared experts of another hidden size",
           range=within(True, "a positive integer", "drop it to use the routed experts' hidden size", low=1,
                        high=WIDEST_FFN, sized_from=FFN_SIZED_FROM, optional=True),
           field="shared_expert_dim"),
    Option("moe_balance", str, "none",
           "'bias': auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the "
           "routing scores for choosing experts only, moved by --moe-bias-update-rate after each update "
           "towards the mean global load; the balance loss still applies unless --moe-gate-loss-wt 0 "
           "(default none)",
           CHANGES_PARAMETERS, "the balance bias is a saved buffer of its own", choices=BALANCE_CHOICES),
    Option("moe_bias_update_rate", Optional[float], None,
           f"with --moe-balance bias: b_i += rate * sign(mean load - load_i) after each update "
           f"(default {DEFAULT_BIAS_UPDATE_RATE})",
           MAY_CHANGE, "how fast the bias moves from now on, like a learning rate",
           range=within(False, "a finite number > 0", "use e.g. 0.001 (the default, DeepSeek-V3's)", low=0,
                        low_open=True, high=FP32_MAX, holder="the fp32 balance bias it moves",
                        smallest=FP32_SMALLEST, optional=True),
           field="routing.balance_bias_rate", to_field=bias_rate, effective=effective_bias_rate),
    Option("moe_balance_scope", str, "micro-batch",
           "the tokens whose first choices give the balance loss its load fractions: micro-batch (every "
           "worker's tokens of this micro-batch) or global-batch (Qiu et al. 2025: every micro-batch of the "
           "update so far, this one included, on every worker; the counts carry no gradient, this "
           "micro-batch's router probabilities do); needs --moe-gate-loss-wt > 0 (default micro-batch)",
           MAY_CHANGE, "which tokens' load the balance loss weighs; " + TRAINING_ONLY
           + " (its counts live within one update, never in a checkpoint)",
           choices=BALANCE_SCOPES, field="balance_scope"),
    Option("moe_freeze", Optional[str], None,
           f"fine-tuning: the parts that do not train, any of {', '.join(FREEZABLE_PARTS)} but not "
           "all, comma-separated: router (every MoE router, and its balance bias), experts (the routed "
           "experts), shared (every other parameter, shared experts included). Frozen parameters get no "
           "gradient, no optimizer state and no all-reduce; with the router frozen the balance loss and "
           "z-loss are logged, not added to the loss (default: nothing frozen)",
           MAY_CHANGE, "which parameters train, not what they compute; a changed set starts a fresh "
           "optimizer state", effective=frozen_parts, parse=parse_frozen_parts),
    Option("moe_expert_ffn_dim", Optional[int], None, "hidden size of each expert (default: the layer's ffn dim)",
           CHANGES_PARAMETERS, "experts of another hidden size",
           range=within(True, "a positive integer", "drop it to use the layer's ffn dim", low=1, high=WIDEST_FFN,
                        sized_from=FFN_SIZED_FROM, optional=True),
           field="hidden_dim"),  # unset: the translation gives the layer's ffn dim
    Option("moe_batch_prioritized_routing", bool, False,
           "when an expert is over capacity, serve tokens with the highest top-1 gate first "
           "instead of in batch order",
           MAY_CHANGE, DROPPED_SLOTS, field="routing.batch_prioritized", hf="batch_prioritized_routing",
           branch="moe_batch_prioritized_routing"),
    Option("moe_eom", float, 0.0,
           "Expert Output Masking (NLLB): in training, each token's output from each of its experts is "
           "zeroed with this probability (the whole vector, no rescaling); in validation and inference every "
           "expert output is multiplied by 1 - p (default 0: off)",
           CHANGES_FUNCTION, "inference multiplies every expert output by 1 - p",
           range=within(False, "a probability in [0, 1)", "use 0 (off) or a rate such as 0.2 (NLLB-200's)", low=0,
                        high=0.999999, holder="a masking rate below 1"),
           field="expert_output_masking", hf="moe_token_dropout"),
    Option("moe_normalize_gate", bool, False, "renormalise each token's k gate values to sum to 1",
           CHANGES_FUNCTION, "the gates a token's expert outputs are weighted with", field="routing.normalize_gates"),
    # The fairseq nllb branch's routing semantics, which import-fairseq-moe sets (docs/interop.md).
    Option("moe_eval_capacity_token_fraction", float, 0.0,
           "evaluation capacity as the nllb branch (and Hugging Face NllbMoe) compute it: ceil(f * S) "
           "slots per expert for both choices together, S being every token position of the batch, pads "
           "included; replaces --moe-eval-capacity-factor in validation and inference (default 0: off)",
           MAY_CHANGE, ROUTING_CAPACITY,
           range=within(False, "a finite number >= 0", "use 0 (off), a fraction such as 0.25 (the nllb branch's "
                        "default) or 1 (nothing dropped)", low=0),
           field="eval_capacity_token_fraction"),
    Option("moe_normalize_gate_after_dropping", bool, False,
           "renormalise each token's gates over the slots kept after capacity dropping (the nllb "
           "branch's default; a token whose second slot is dropped weights its first by 1) instead of "
           "before, as --moe-normalize-gate does; implies that normalisation",
           CHANGES_FUNCTION, "the gates of tokens that lost a slot", field="routing.normalize_gates_after_dropping"),
    Option("moe_batch_major_routing", bool, False,
           "queue tokens for capacity sentence by sentence (B x T, as the nllb branch and Hugging "
           "Face route) instead of time step by time step (the T x B order of fairseq's layers); only "
           "which slots are dropped differs",
           MAY_CHANGE, DROPPED_SLOTS),  # MoEFeedForward's batch_major, beside the layer's config
    Option("moe_second_expert_policy", str, "all",
           "top-2 only, the nllb branch's: all = the second-best expert; sampling = drawn by "
           "logits + Gumbel noise among the others; random = the second-best, kept with probability "
           "min(1, 2 * its gate). sampling and random draw in validation and inference too, as the branch "
           "does (default all)",
           CHANGES_FUNCTION, "which second expert a token reaches, drawn at random or not",
           choices=tuple(SECOND_EXPERT_POLICIES), field="routing.second_expert_policy"),
)

TRANSLATION_OPTIONS = (
    Option("encoder_moe_freq", Optional[int], None, "--moe-freq for encoder layers (default: --moe-freq)",
           CHANGES_PARAMETERS, "other encoder layers are MoE", where=TRANSLATION,
           range=within(True, "an integer >= 0", FREQ_FIX, low=0, optional=True)),
    Option("encoder_moe_expert_count", Optional[int], None,
           "--moe-expert-count for encoder MoE layers (default: --moe-expert-count)",
           CHANGES_PARAMETERS, "another number of encoder experts and router rows", where=TRANSLATION,
           range=within(True, "a positive integer", SIDE_EXPERTS_FIX, low=1, high=MOST_EXPERTS,
                        sized_from=EXPERTS_SIZED_FROM, optional=True)),
)
# fmt: on
