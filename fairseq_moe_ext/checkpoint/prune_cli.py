"""The checkpoint tool's ``prune`` subcommand, a row of fairseq_moe_ext/console.py's registry (prune.py does the
work)."""

import math

from ..moe.expert_layout import divides_layout, valid_parallel_sizes
from .errors import CheckpointSetError
from .names import base_of
from .prune import METRIC_NAMES, prune
from .reshard import load_full, save_set
from .sets_cli import refuse_overwrite, refusing


def add_prune_parser(p) -> None:
    p.add_argument("checkpoint", help="the set or file to prune, e.g. save_dir/checkpoint_best.pt")
    p.add_argument("output", help="output name, e.g. pruned/checkpoint_best.pt (a new name)")
    how_many = p.add_mutually_exclusive_group(required=True)
    how_many.add_argument("--keep", type=int, help="experts each MoE layer keeps (k..E)")
    how_many.add_argument("--keep-fraction", type=float, help="the share of each layer's experts kept, e.g. 0.25")
    p.add_argument(
        "--stats", required=True, help="routing statistics of this checkpoint (fairseq-generate --moe-routing-stats)"
    )
    p.add_argument(
        "--group",
        action="append",
        default=None,
        metavar="KEY",
        help="rank experts for these groups of the statistics (a language, a domain; repeatable); default: all",
    )
    p.add_argument(
        "--metric",
        choices=sorted(METRIC_NAMES),
        default="gate-mass",
        help="what ranks the experts: top1 (first choices), topk (all k choices) or gate-mass (the gate weight "
        "they received; default)",
    )
    p.add_argument(
        "--encoder-decoder-ratio",
        type=float,
        default=None,
        metavar="R",
        help="experts kept per encoder MoE layer for each one kept per decoder MoE layer, the total over all MoE "
        "layers staying what --keep/--keep-fraction keeps: T experts over L_enc encoder and L_dec decoder MoE "
        "layers, each decoder layer keeps b = round(T / (R*L_enc + L_dec)), each encoder layer round((T - "
        "L_dec*b) / L_enc); each side keeps k..E. Koishekenov et al. (2023) found 3 best for NLLB-200 (more "
        "encoder experts); R < 1 keeps more decoder experts (default: the same number on both sides)",
    )
    p.add_argument(
        "--world-size", type=int, default=1, help="W: the pruned set's rank files (W must divide the experts kept)"
    )


@refusing
def prune_command(args) -> int:
    refuse_overwrite(args.output)
    if args.world_size < 1:
        raise CheckpointSetError(f"--world-size must be a positive number of workers, got {args.world_size}")
    full = load_full(args.checkpoint)
    pruned = prune(
        full,
        args.stats,
        keep=args.keep,
        fraction=args.keep_fraction,
        metric=args.metric,
        groups=args.group,
        source=args.checkpoint,
        ratio=args.encoder_decoder_ratio,
    )
    kept = pruned["moe"]["pruned"]["kept"]
    counts = sorted({len(ids) for ids in kept.values()})
    if not divides_layout(args.world_size, args.world_size, *counts):
        divisors = valid_parallel_sizes(counts[0], *counts)  # each set's workers hold E/W experts: W = P
        experts = " and ".join(map(str, counts))
        raise CheckpointSetError(
            f"--world-size {args.world_size} does not divide the {experts} experts kept: use one of {divisors}"
        )
    written = save_set(pruned, base_of(args.output), args.world_size, extra={"pruned": pruned["moe"]["pruned"]})
    for layer, ids in kept.items():
        print(f"{layer}: kept experts {ids}")
    sides = {layer.split(".", 1)[0]: len(ids) for layer, ids in kept.items()}
    if len(counts) == 1:
        print(
            f"wrote {written} ({counts[0]} experts per MoE layer, {math.ceil(counts[0] / args.world_size)} per worker)"
        )
    else:
        per_side = ", ".join(f"{side} {n} ({math.ceil(n / args.world_size)} per worker)" for side, n in sides.items())
        print(f"wrote {written} (experts per MoE layer: {per_side})")
    return 0
