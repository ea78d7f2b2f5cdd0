"""The MoE architectures' options that steer a run rather than the model: communication, determinism,
what a resume may do, sparse upcycling. One record each (``record.Option``), as in ``model.py``."""

from typing import Optional

from .record import FP32_MAX, MAY_CHANGE, TIMEDELTA_MAX_S, Option, within

# The routers' default initial std when a dense checkpoint is upcycled. At a zero router every token
# ties and topk picks the same k experts for all of them: with experts on several workers one worker
# then receives every row of every MoE layer. Any std > 0 spreads the tokens and keeps the dense
# function (normalised gates); small, so the gates start near uniform.
DEFAULT_ROUTER_STD = 0.01
FIRST_LAUNCH = "used only by a run's first launch"


def launch_option(name, type_, default, help_text, why, **more) -> Option:
    """An option read from the command line when a run starts, which shapes no model (the architectures
    never write it into a model's args), so it may change on resume."""
    return Option(name, type_, default, help_text, MAY_CHANGE, why, launch_only=True, **more)


# fmt: off
RUN_OPTIONS = (
    Option("moe_fully_sharded_unit", str, "layer",
           "--ddp-backend fully_sharded: what FSDP2 gathers at a time. layer: each transformer "
           "layer (an MoE layer whole), the embeddings and output projection with the root (least "
           "memory); model: every shared parameter at once (fewest collectives, the whole shared part "
           "gathered during forward and backward) (default layer)",
           MAY_CHANGE, "how FSDP2 gathers the shared part, not what it computes", choices=("layer", "model")),
    Option("moe_fully_sharded_experts", str, "whole",
           "--ddp-backend fully_sharded with fewer expert-parallel workers than workers (P < W): whole: "
           "each worker holds its E/P experts whole, their gradients all-reduced over the W/P workers "
           "holding the same experts; sharded: FSDP2 over those W/P workers cuts each MoE layer's E/P "
           "experts along the expert dimension, so each worker holds 1/(W/P) of their parameters, "
           "gradients and optimizer state, one MoE layer's experts gathered at a time (default whole)",
           MAY_CHANGE, "how the experts are held, not what they compute", choices=("whole", "sharded")),
    # 600 s: torch's NCCL default, the timeout of fairseq's own collectives on GPUs. Workers reach an
    # MoE collective as far apart as they reach fairseq's gradient all-reduce (the same per-step
    # skew), so it needs no more patience; on NCCL a dead peer is only seen when it runs out (the
    # watchdog then aborts the job), and 1800 s kept every GPU idle for half an hour.
    Option("moe_comm_timeout", float, 600.0,
           "seconds a worker waits for its peers in an MoE collective before it fails (default 600, "
           "torch's NCCL default, as fairseq's own collectives on GPUs): on gloo with "
           "MoECommunicationError, on NCCL by the watchdog aborting the job; on gloo a peer that died "
           "fails it at once",
           MAY_CHANGE, "how long a collective waits for a stalled peer",
           range=within(False, "a positive number of seconds", "use e.g. 600 (the default)", low=0, low_open=True,
                        high=TIMEDELTA_MAX_S, holder="a timedelta (torch's process-group timeout)", smallest=0.001)),
    Option("moe_deterministic", bool, False,
           "bit-reproducible training on GPU: torch.use_deterministic_algorithms(True) and "
           "deterministic cuBLAS for the whole run, at some speed cost (the MoE layer itself never "
           "accumulates with atomics; CPU runs are reproducible without this flag)",
           MAY_CHANGE, "reproducibility of the kernels, not the function"),
    # Read from the command line by the checkpoint loader (absent means no fallback): they shape no
    # model, and the architectures have never written them into a model's args.
    launch_option("moe_restore_fallback", bool, False,
           "fairseq-train: when the checkpoint named by --restore-file (or --continue-once, "
           "--finetune-from-model) is an incomplete or damaged set, train from the newest complete set "
           "in its directory, with a warning, instead of refusing (the default checkpoint_last.pt in "
           "--save-dir always falls back)",
           "which checkpoint a damaged one falls back to"),
    launch_option("moe_allow_function_change", bool, False,
           "fairseq-train: resume (or --finetune-from-model) with options that change what the saved "
           "weights compute (--moe-router, --moe-top-k, --moe-normalize-gate, --activation-fn), each change "
           "logged as a warning; without it such a resume is refused (docs/checkpoints.md: what may change "
           "on resume)",
           "this check's own override"),
    # Sparse upcycling (training/upcycling.py): read from the command line when training starts.
    launch_option("moe_upcycle_from", Optional[str], None,
           "fairseq-train: start from this dense fairseq checkpoint (transformer / transformer_lm) "
           "when --save-dir has no checkpoint_last: every expert a copy of its layer's dense FFN, the "
           "router at zero, a fresh optimizer (needs --moe-normalize-gate; then the model starts as the "
           "dense one)",
           FIRST_LAUNCH, matrix=("{dense} --moe-normalize-gate",)),
    launch_option("moe_upcycle_noise", float, 0.0,
           "with --moe-upcycle-from: std of Gaussian noise added to each expert's "
           "copy (seeded by --seed; default 0: exact copies)",
           FIRST_LAUNCH,
           range=within(False, "a finite number >= 0", "use 0 (exact copies) or a small standard deviation such "
                        "as 0.001", low=0, high=FP32_MAX, holder="the fp32 noise added to the experts")),
    launch_option("moe_upcycle_router_std", float, DEFAULT_ROUTER_STD,
           f"with --moe-upcycle-from: std of the router's initial weights (seeded by --seed; default "
           f"{DEFAULT_ROUTER_STD:g}: tokens spread over the experts; 0: every token picks the same experts)",
           FIRST_LAUNCH,
           range=within(False, "a finite number >= 0", "use 0 (a zero router) or a small standard deviation such "
                        "as 0.01", low=0, high=FP32_MAX, holder="the fp32 router weights drawn with it")),
)
# fmt: on
