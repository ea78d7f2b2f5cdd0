"""The runs the expert-pruning CLI tests share (tests/cli/test_routing_stats_cli.py,
test_expert_pruning_cli.py): a 1-process moe_transformer_tiny run (4 experts, k=2, 20 updates)
resharded into a 2-worker set, a groups file for the test subset, and fairseq-generate's command
line with --moe-routing-stats."""

import json

from support.launch.fairseq_helpers import SPLITS, USER_DIR, run_checkpoint_tool, run_fairseq
from support.launch.multiworker_cli_runs import moe_args

BEAM = ["--beam", "2", "--max-tokens", "2000"]


def train_tiny_set(data, root, experts=None):
    """{"data", "root", "set": the 2-worker set's name, "groups": even/odd per test sentence}; ``experts``
    replaces moe_args' expert count per MoE layer."""
    args = moe_args(data, root / "one", 20, "--no-epoch-checkpoints")
    if experts is not None:
        args[args.index("--moe-expert-count") + 1] = str(experts)
    run_fairseq("train", *args)
    (root / "set").mkdir()
    run_checkpoint_tool(
        "reshard", root / "one" / "checkpoint_last.pt", root / "set" / "ck.pt", "--world-size", "2", check=True
    )
    groups = root / "groups.txt"
    groups.write_text("".join("even\n" if i % 2 == 0 else "odd\n" for i in range(SPLITS["test"])))
    return {"data": data, "root": root, "set": root / "set" / "ck.pt", "groups": groups}


def stats_args(data, path, output, *extra):
    return [
        str(data),
        "--user-dir",
        USER_DIR,
        "--path",
        str(path),
        "--cpu",
        "--num-workers",
        "0",
        "--gen-subset",
        "test",
        *BEAM,
        "--moe-routing-stats",
        str(output),
        *extra,
    ]


def statistics(path):
    return json.loads(path.read_text())
