"""The inference CLIs' ``--moe-*`` flags (generate, interactive, eval-lm, validate): one record each, as
the architectures' (``record.Option``). fairseq builds these CLIs' parsers without the model's
dataclass, so the plugin adds each record as an argparse flag
(``fairseq_integration/inference.add_inference_experts_flag``). A flag of one inference run, never
saved with a checkpoint: no resume rule applies (``POLICY`` leaves them out)."""

from typing import Optional

from .record import INFERENCE, MAY_CHANGE, Option

EXPERT_PLACEMENTS = ("auto", "sharded", "local")

# fmt: off
INFERENCE_OPTIONS = (
    Option("moe_inference_experts", str, "auto",
           "inference CLIs on N > 1 torchrun workers: 'sharded' keeps each worker's experts on it (N must "
           "divide the experts; every worker joins every MoE call), 'local' gives every worker every expert; "
           "'auto' (default) is sharded when the checkpoint set was saved by N workers, else local",
           MAY_CHANGE, "a choice of each inference run, never saved", where=INFERENCE, choices=EXPERT_PLACEMENTS),
    Option("moe_routing_stats", Optional[str], None,
           "fairseq-generate and fairseq-validate: write per MoE layer, group and expert the top-1 count, "
           "top-k count and gate mass over the real tokens to this JSON file (what the checkpoint tool's prune "
           "reads); one process or experts sharded, the same counts",
           MAY_CHANGE, "a choice of each inference run, never saved", where=INFERENCE),
    Option("moe_routing_stats_groups", Optional[str], None,
           "with --moe-routing-stats: a key (a domain, a language) per line of the evaluated subset, by "
           "sentence id; default: the source language on the encoder side, the target language on the decoder "
           "side",
           MAY_CHANGE, "a choice of each inference run, never saved", where=INFERENCE),
)
# fmt: on
