"""The routing-statistics flags of fairseq-generate and fairseq-validate, declared apart from what they do
(routing_stats.py) so that their declaration can move on its own."""


def add_routing_stats_flags(parser) -> None:
    if any("--moe-routing-stats" in a.option_strings for a in parser._actions):
        return
    parser.add_argument(
        "--moe-routing-stats",
        metavar="FILE",
        default=None,
        help="fairseq-generate and fairseq-validate: write per MoE layer, group and expert the top-1 count, "
        "top-k count and gate mass over the real tokens to this JSON file (what the checkpoint tool's prune "
        "reads); one process or experts sharded, the same counts",
    )
    parser.add_argument(
        "--moe-routing-stats-groups",
        metavar="FILE",
        default=None,
        help="with --moe-routing-stats: a key (a domain, a language) per line of the evaluated subset, by "
        "sentence id; default: the source language on the encoder side, the target language on the decoder side",
    )
