"""The checkpoint tool's ``upcycle`` subcommand, a row of fairseq_moe_ext/console.py's registry: its flags, the
conversion they ask for and the checkpoint written.

The flags are named as fairseq-train's, so the MoE part of a training command can be copied over.
fairseq is imported only when the subcommand runs (the architecture and criterion registries decide
which MoE architecture a dense checkpoint becomes; see ``upcycling.py``).
"""

from ..checkpoint.sets_cli import check_world_size, refuse_overwrite, refusing, write_merged, write_set
from ..checkpoint.upcycle import DEFAULT_ROUTER_STD


def add_upcycle_parser(p) -> None:
    p.add_argument(
        "checkpoint", help="the dense checkpoint, e.g. dense/checkpoint_best.pt (transformer*, transformer_lm*)"
    )
    p.add_argument(
        "output", help="output name, e.g. moe/checkpoint_upcycled.pt (a set of rank files if --world-size > 1)"
    )
    p.add_argument("--moe-expert-count", type=int, required=True, help="experts per MoE layer (E)")
    p.add_argument("--moe-top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument(
        "--moe-freq",
        type=int,
        default=None,
        help="layer i (0-based) becomes MoE when (i + 1) %% freq == 0, the others keep their dense FFN "
        "(default: fairseq-train's, 2)",
    )
    p.add_argument("--encoder-moe-freq", type=int, default=None, help="--moe-freq for the encoder")
    p.add_argument("--decoder-moe-freq", type=int, default=None, help="--moe-freq for the decoder")
    p.add_argument(
        "--moe-expert-ffn-dim",
        type=int,
        default=None,
        help="accepted only equal to the dense FFN's hidden size (experts are copies of it)",
    )
    p.add_argument(
        "--world-size", type=int, default=1, help="W: write a set for W workers (1, the default: one ordinary file)"
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="std of Gaussian noise added to every expert's copy (default 0: exact copies, the dense function)",
    )
    p.add_argument(
        "--router-std",
        type=float,
        default=DEFAULT_ROUTER_STD,
        help=f"std of the routers' initial weights (default {DEFAULT_ROUTER_STD:g}: tokens spread over the "
        f"experts; 0: every token picks the same experts); any value keeps the dense function",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the noise and the router weights (default 1)")


@refusing
def upcycle_command(args) -> int:
    # Everything that can be checked before loading is checked before loading.
    refuse_overwrite(args.output)
    check_world_size(args.world_size)
    full = upcycle(args)
    if args.world_size == 1:
        print(f"wrote {write_merged(full, args.output)}")
    else:
        write_set(full, args)
    return 0


def upcycle(args):
    """The whole upcycled checkpoint the parsed ``args`` ask for."""
    from ..checkpoint.errors import CheckpointSetError
    from ..options.ranges import UPCYCLE_TOOL_RANGES, check_options
    from .upcycling import upcycled_checkpoint

    try:
        check_options(UPCYCLE_TOOL_RANGES, lambda name: getattr(args, name))
    except ValueError as e:
        raise CheckpointSetError(str(e)) from None
    flags = dict(
        moe_expert_count=args.moe_expert_count,
        moe_top_k=args.moe_top_k,
        moe_freq=args.moe_freq,
        encoder_moe_freq=args.encoder_moe_freq,
        decoder_moe_freq=args.decoder_moe_freq,
        moe_expert_ffn_dim=args.moe_expert_ffn_dim,
    )
    return upcycled_checkpoint(args.checkpoint, flags, args.noise, args.router_std, args.seed)
