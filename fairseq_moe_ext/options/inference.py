"""The inference CLIs' ``--moe-*`` flags (generate, interactive, eval-lm, validate): one record each, as
the architectures' (``record.Option``). fairseq builds these CLIs' parsers without the model's
dataclass, so the plugin adds each record as an argparse flag
(``fairseq_integration/inference.add_inference_experts_flag``). A flag of one inference run, never
saved with a checkpoint: no resume rule applies (``POLICY`` leaves them out)."""

from .record import INFERENCE, MAY_CHANGE, Option

EXPERT_PLACEMENTS = ("auto", "sharded", "local")

# fmt: off
INFERENCE_OPTIONS = (
    Option("moe_inference_experts", str, "auto",
           "inference CLIs on N > 1 torchrun workers: 'sharded' keeps each worker's experts on it (N must "
           "divide the experts; every worker joins every MoE call), 'local' gives every worker every expert; "
           "'auto' (default) is sharded when the checkpoint set was saved by N workers, else local",
           MAY_CHANGE, "a choice of each inference run, never saved", where=INFERENCE, choices=EXPERT_PLACEMENTS),
)
# fmt: on
