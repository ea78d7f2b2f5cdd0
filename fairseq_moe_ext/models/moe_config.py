"""The ``--moe-*`` model options, named after fairseq's ``moe`` branch where it had them."""

import logging
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional


from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..distributed import (
    EXPERT_GRAD_NORMALIZATIONS,
)
from ..checkpoint.config_value import config_value
from ..checkpoint.upcycle import DEFAULT_ROUTER_STD
from ..moe.balance_bias import DEFAULT_BIAS_UPDATE_RATE
from ..moe.placement import places_moe_layer, side_moe_freq
from ..moe.router import ROUTER_TYPES
from ..moe.second_expert import SECOND_EXPERT_POLICIES
from ..option_ranges import MODEL_RANGES, check_option, check_options
from ..moe.refusal import MoEOptionError

logger = logging.getLogger(__name__)

MOE_ROUTER_CHOICES = ChoiceEnum(list(ROUTER_TYPES))
MOE_BALANCE_CHOICES = ChoiceEnum(["none", "bias"])
MOE_SECOND_EXPERT_CHOICES = ChoiceEnum(list(SECOND_EXPERT_POLICIES))
MOE_EXPERT_GRAD_CHOICES = ChoiceEnum(list(EXPERT_GRAD_NORMALIZATIONS))


# fmt: off
@dataclass
class MoEConfig(FairseqDataclass):
    moe_expert_count: int = field(
        default=8, metadata={"help": "number of experts in each MoE layer, over all workers (default 8)"}
    )
    moe_expert_parallel_size: Optional[int] = field(
        default=None,
        metadata={"help": "expert-parallel size P: each group of P consecutive workers holds every expert once "
                  "(E/P per worker, tokens reach them by all-to-all within the group) and the W/P groups are "
                  "replicas whose expert gradients are summed; must divide both the number of workers and "
                  "--moe-expert-count. Larger P: less expert memory per worker, all-to-alls over more workers "
                  "(keep a group within a node) (default: the largest such P, gcd(workers, experts))"},
    )
    moe_normalize_expert_grad: MOE_EXPERT_GRAD_CHOICES = field(
        default="world_size",
        metadata={"help": "world_size: expert gradients equal the one-process gradient, as shared ones do; "
                  "sqrt_world_size (the nllb branch's option): sqrt(P) times it, P the expert-parallel size, "
                  "before clipping, like a sqrt(P) larger learning rate on experts; no change on one worker "
                  "(default world_size)"},
    )
    moe_freq: int = field(
        default=2,
        metadata={"help": "layer i (0-based) is an MoE layer when (i + 1) % freq == 0; 0: no MoE layer on that "
                  "side; the model needs at least one MoE layer (default 2: every other layer)"},
    )
    decoder_moe_freq: Optional[int] = field(
        default=None, metadata={"help": "--moe-freq for decoder layers (default: --moe-freq)"}
    )
    moe_top_k: int = field(default=2, metadata={"help": "experts per token (default 2)"})
    moe_capacity_factor: float = field(
        default=0.0,
        metadata={"help": "training capacity, Tutel semantics with N tokens over all workers: > 0 keeps "
                  "k*int(cf*ceil(N/E)) slots per expert and drops the rest; 0 is dropless; < 0 is "
                  "dropless up to k*int(|cf|*ceil(N/E)) (default 0)"},
    )
    moe_eval_capacity_factor: float = field(
        default=0.0,
        metadata={"help": "capacity factor in validation and inference (default 0: dropless, so outputs "
                  "do not depend on batch composition)"},
    )
    moe_gate_noise: float = field(
        default=0.0,
        metadata={"help": "std of Gaussian noise (divided by E) added to router logits when choosing "
                  "experts in training only (default 0)"},
    )
    moe_gating_use_fp32: bool = field(
        default=False,
        metadata={"help": "accepted for compatibility with fairseq's moe branch: routing already runs in "
                  "fp32 unless --moe-gating-no-fp32"},
    )
    moe_gating_no_fp32: bool = field(
        default=False, metadata={"help": "run the router in the activation dtype instead of fp32"}
    )
    moe_router: MOE_ROUTER_CHOICES = field(
        default="top",
        metadata={"help": "router: 'top' (linear logits, softmax), 'cosine' (Tutel's cosine_top: projected "
                  "cosine similarity times a learned temperature clamped at 100) or 'sigmoid' (DeepSeek-V3: "
                  "sigmoid scores, gates = the chosen k scores normalised to sum to 1; needs k >= 2) (default top)"},
    )
    moe_shared_expert_count: int = field(
        default=0,
        metadata={"help": "shared experts (DeepSeek-MoE) per MoE layer: always active, run as one dense FFN beside "
                  "the routed experts and added to their output; replicated like shared parameters (default 0)"},
    )
    moe_shared_expert_ffn_dim: Optional[int] = field(
        default=None,
        metadata={"help": "hidden size of each shared expert (default: the routed experts' hidden size)"},
    )
    moe_balance: MOE_BALANCE_CHOICES = field(
        default="none",
        metadata={"help": "'bias': auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the "
                  "routing scores for choosing experts only, moved by --moe-bias-update-rate after each update "
                  "towards the mean global load; the balance loss still applies unless --moe-gate-loss-wt 0 "
                  "(default none)"},
    )
    moe_bias_update_rate: Optional[float] = field(
        default=None,
        metadata={"help": f"with --moe-balance bias: b_i += rate * sign(mean load - load_i) after each update "
                  f"(default {DEFAULT_BIAS_UPDATE_RATE})"},
    )
    moe_expert_ffn_dim: Optional[int] = field(
        default=None, metadata={"help": "hidden size of each expert (default: the layer's ffn dim)"}
    )
    moe_batch_prioritized_routing: bool = field(
        default=False,
        metadata={"help": "when an expert is over capacity, serve tokens with the highest top-1 gate first "
                  "instead of in batch order"},
    )
    moe_eom: float = field(
        default=0.0,
        metadata={"help": "Expert Output Masking (NLLB): in training, each token's output from each of its experts is "
                  "zeroed with this probability (the whole vector, no rescaling); in validation and inference every "
                  "expert output is multiplied by 1 - p (default 0: off)"},
    )
    moe_normalize_gate: bool = field(
        default=False, metadata={"help": "renormalise each token's k gate values to sum to 1"}
    )
    # The fairseq nllb branch's routing semantics, which import-fairseq-moe sets (docs/interop.md).
    moe_eval_capacity_token_fraction: float = field(
        default=0.0,
        metadata={"help": "evaluation capacity as the nllb branch (and Hugging Face NllbMoe) compute it: ceil(f * S) "
                  "slots per expert for both choices together, S being every token position of the batch, pads "
                  "included; replaces --moe-eval-capacity-factor in validation and inference (default 0: off)"},
    )
    moe_normalize_gate_after_dropping: bool = field(
        default=False,
        metadata={"help": "renormalise each token's gates over the slots kept after capacity dropping (the nllb "
                  "branch's default; a token whose second slot is dropped weights its first by 1) instead of "
                  "before, as --moe-normalize-gate does; implies that normalisation"},
    )
    moe_batch_major_routing: bool = field(
        default=False,
        metadata={"help": "queue tokens for capacity sentence by sentence (B x T, as the nllb branch and Hugging "
                  "Face route) instead of time step by time step (the T x B order of fairseq's layers); only "
                  "which slots are dropped differs"},
    )
    moe_second_expert_policy: MOE_SECOND_EXPERT_CHOICES = field(
        default="all",
        metadata={"help": "top-2 only, the nllb branch's: all = the second-best expert; sampling = drawn by "
                  "logits + Gumbel noise among the others; random = the second-best, kept with probability "
                  "min(1, 2 * its gate). sampling and random draw in validation and inference too, as the branch "
                  "does (default all)"},
    )
    # 600 s: torch's NCCL default, the timeout of fairseq's own collectives on GPUs. Workers reach an
    # MoE collective as far apart as they reach fairseq's gradient all-reduce (the same per-step
    # skew), so it needs no more patience; on NCCL a dead peer is only seen when it runs out (the
    # watchdog then aborts the job), and 1800 s kept every GPU idle for half an hour.
    moe_comm_timeout: float = field(
        default=600.0,
        metadata={"help": "seconds a worker waits for its peers in an MoE collective before it fails (default 600, "
                  "torch's NCCL default, as fairseq's own collectives on GPUs): on gloo with "
                  "MoECommunicationError, on NCCL by the watchdog aborting the job; on gloo a peer that died "
                  "fails it at once"},
    )
    moe_deterministic: bool = field(
        default=False,
        metadata={"help": "bit-reproducible training on GPU: torch.use_deterministic_algorithms(True) and "
                  "deterministic cuBLAS for the whole run, at some speed cost (the MoE layer itself never "
                  "accumulates with atomics; CPU runs are reproducible without this flag)"},
    )

    moe_restore_fallback: bool = field(
        default=False,
        metadata={"help": "fairseq-train: when the checkpoint named by --restore-file (or --continue-once, "
                  "--finetune-from-model) is an incomplete or damaged set, train from the newest complete set "
                  "in its directory, with a warning, instead of refusing (the default checkpoint_last.pt in "
                  "--save-dir always falls back)"},
    )
    moe_allow_function_change: bool = field(
        default=False,
        metadata={"help": "fairseq-train: resume (or --finetune-from-model) with options that change what the saved "
                  "weights compute (--moe-router, --moe-top-k, --moe-normalize-gate, --activation-fn), each change "
                  "logged as a warning; without it such a resume is refused (docs/checkpoints.md: what may change "
                  "on resume)"},
    )
    # Sparse upcycling (training/upcycling.py): read from the command line when training starts, like the above.
    moe_upcycle_from: Optional[str] = field(
        default=None,
        metadata={"help": "fairseq-train: start from this dense fairseq checkpoint (transformer / transformer_lm) "
                  "when --save-dir has no checkpoint_last: every expert a copy of its layer's dense FFN, the "
                  "router at zero, a fresh optimizer (needs --moe-normalize-gate; then the model starts as the "
                  "dense one)"},
    )
    moe_upcycle_noise: float = field(
        default=0.0, metadata={"help": "with --moe-upcycle-from: std of Gaussian noise added to each expert's "
                               "copy (seeded by --seed; default 0: exact copies)"},
    )
    moe_upcycle_router_std: float = field(
        default=DEFAULT_ROUTER_STD,
        metadata={"help": f"with --moe-upcycle-from: std of the router's initial weights (seeded by --seed; default "
                  f"{DEFAULT_ROUTER_STD:g}: tokens spread over the experts; 0: every token picks the same experts)"},
    )
# fmt: on


@dataclass
class MoEEncoderDecoderConfig(MoEConfig):
    encoder_moe_freq: Optional[int] = field(
        default=None, metadata={"help": "--moe-freq for encoder layers (default: --moe-freq)"}
    )


# Every --moe-* option of either architecture (the translation config is the larger one).
_MOE_FIELDS = {f.name: f for f in fields(MoEEncoderDecoderConfig) if f.name != "_name"}
MOE_OPTIONS = tuple(_MOE_FIELDS)


def moe_default(name: str):
    """The default of option ``name``: the dataclass field is the only place defaults are written."""
    spec = _MOE_FIELDS[name]
    # A default_factory makes a fresh value per call, so no two namespaces share a mutable default.
    return spec.default_factory() if spec.default is MISSING else spec.default


def moe_option(args, name: str):
    """``args.<name>``, or the option's default where ``args`` lacks it."""
    return config_value(args, name, moe_default(name))


def moe_freq(args, side: str) -> int:
    return side_moe_freq(moe_option(args, "moe_freq"), moe_option(args, f"{side}_moe_freq"))


def check_moe_args(args) -> None:
    """Fail before anything is built, with one line that names the flag and the fix: every numeric
    option against the range of what it is used in (``option_ranges.MODEL_RANGES``), then the
    options against each other."""
    experts = moe_option(args, "moe_expert_count")
    check_option(MODEL_RANGES["moe_expert_count"], experts)
    check_options(MODEL_RANGES, lambda name: moe_option(args, name), experts=experts)
    k = moe_option(args, "moe_top_k")
    if k > experts:
        raise MoEOptionError(f"--moe-top-k {k} exceeds --moe-expert-count {experts}: use --moe-top-k <= {experts}")
    check_routing_extensions(args, k)


def check_routing_extensions(args, k: int) -> None:
    """Shared experts, loss-free balancing and the sigmoid router."""
    shared_dim = moe_option(args, "moe_shared_expert_ffn_dim")
    if shared_dim is not None and moe_option(args, "moe_shared_expert_count") == 0:
        raise MoEOptionError(
            f"--moe-shared-expert-ffn-dim {shared_dim} needs --moe-shared-expert-count >= 1: add shared experts or "
            f"drop the flag"
        )
    if moe_option(args, "moe_bias_update_rate") is not None and str(moe_option(args, "moe_balance")) != "bias":
        raise MoEOptionError("--moe-bias-update-rate has no effect without --moe-balance bias: add it or drop the rate")
    policy = str(moe_option(args, "moe_second_expert_policy"))
    if policy != "all" and (k != 2 or str(moe_option(args, "moe_router")) != "top"):
        raise MoEOptionError(
            f"--moe-second-expert-policy {policy} is the nllb branch's top-2 softmax gate's: use "
            f"--moe-top-k 2 with --moe-router top, or drop the flag"
        )
    if moe_option(args, "moe_normalize_gate_after_dropping") and str(moe_option(args, "moe_router")) != "top":
        raise MoEOptionError(
            "--moe-normalize-gate-after-dropping renormalises softmax probabilities: use it with "
            "--moe-router top, or drop it"
        )
    if str(moe_option(args, "moe_router")) == "sigmoid" and k < 2:
        raise MoEOptionError(
            "--moe-router sigmoid normalises the gates over the chosen experts, so with --moe-top-k 1 every gate is 1 "
            "and the router never learns: use --moe-top-k 2 or more, or --moe-router top"
        )


def bias_update_rate(args) -> Optional[float]:
    """The rate of --moe-balance bias, or None without it."""
    if str(moe_option(args, "moe_balance")) != "bias":
        return None
    rate = moe_option(args, "moe_bias_update_rate")
    return DEFAULT_BIAS_UPDATE_RATE if rate is None else float(rate)


def check_moe_layers_placed(args, sides) -> None:
    """An MoE architecture whose --moe-freq places no MoE layer would train a dense model under an
    MoE name; refuse it (a model without experts is what the dense architectures are for)."""
    layers = {side: int(config_value(args, f"{side}_layers") or 0) for side in sides}
    freqs = {side: moe_freq(args, side) for side in sides}
    if any(places_moe_layer(layers[side], freq) for side, freq in freqs.items()):
        return
    given = []
    for side in sides:
        own = moe_option(args, f"{side}_moe_freq") is not None
        flag = f"--{side}-moe-freq {freqs[side]}" if own else f"--moe-freq {freqs[side]}"
        if flag not in given:
            given.append(flag)
    counts = " and ".join(f"{layers[side]} {side} layers" for side in sides)
    most = max(layers.values())
    raise MoEOptionError(
        f"{' / '.join(given)} places no MoE layer in this model ({counts}; layer i is an MoE layer when (i + 1) is a "
        f"multiple of the frequency): use a frequency between 1 and {most}, or a dense --arch (transformer, "
        f"transformer_lm) for a model without experts"
    )
