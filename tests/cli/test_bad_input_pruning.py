"""Bad input, expert pruning: the checkpoint tool's prune refuses what would write a wrong or unusable
set (fewer experts than k, more than E, statistics of another model or checkpoint, an unknown group,
an output that holds a set, a world size not dividing the experts kept, an encoder:decoder ratio that
is not > 0 or leaves a side outside k..E), a set whose sides differ is refused where it cannot go
(export-hf; top-k or P not fitting a side), and --moe-routing-stats refuses what it cannot count. The same table-driven runner as tests/cli/test_bad_input.py (each case
through the real command line: a non-zero exit, one last line naming the problem and the fix, no file
changed or added).
"""

import json

import pytest
import torch

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint.prune import moe_layers
from fairseq_moe_ext.checkpoint.prune import prune as prune_state_of
from fairseq_moe_ext.checkpoint.reshard import save_set
from fairseq_moe_ext.moe.routing_stats import RoutingTally, statistics_document
from support.inputs.bad_input_entry_points import refused_by
from support.inputs.bad_input_makers import checkpoint_tool_on, fresh_training, generate_args
from support.launch.bad_input_runner import (
    GENERATE,
    LAUNCHED_TRAIN,
    TRAIN,
    Case,
    Make,
    check_case,
    checkpoint_tool,
    copy_of,
    fairseq_generate,
    fairseq_train,
    train_args,
    two_workers,
)
from support.launch.fairseq_helpers import SPLITS, USER_DIR

pytestmark = pytest.mark.slow


def statistics_of(set_dir, layers=None, set_id=None):
    """Routing statistics for the set in ``set_dir`` (every expert used alike by groups ``a`` and ``b``),
    or, with ``layers`` / ``set_id``, for another model or checkpoint."""
    full = moe_ckpt.load_full(str(set_dir / "checkpoint_last.pt"))
    layers = layers or moe_layers(full)
    tally = RoutingTally()
    for layer, experts in layers.items():
        index = torch.arange(2 * experts).remainder(experts).view(-1, 2)
        tally.add(layer, experts, index, torch.full(index.shape, 0.5), torch.arange(experts) % 2, ["a", "b"])
    identity = {"set_id": set_id or full["moe"].get("set_id"), "num_updates": full["moe"]["num_updates"]}
    document = statistics_document(tally, dict(identity, layers=layers, top_k=2), "file x", {})
    path = set_dir.parent / "stats.json"
    path.write_text(json.dumps(document))
    return path


def prune(*flags, existing=None, stats=statistics_of):
    """``prune in/checkpoint_last.pt out/checkpoint_last.pt --stats S *flags`` (S made by ``stats``)."""
    base = checkpoint_tool_on("prune", *flags, existing=existing)

    def make(inputs, work):
        args, watched = base(inputs, work)
        return [*args, "--stats", stats(work / "in")], watched

    return make


def other_layers(set_dir):
    return statistics_of(
        set_dir, layers={k: 8 for k in moe_layers(moe_ckpt.load_full(str(set_dir / "checkpoint_last.pt")))}
    )


def export_unequal_sides(inputs, work):
    """export-hf of a set pruned to 2 encoder and 4 decoder experts (prune --keep 3 --encoder-decoder-ratio 0.5)."""
    source = copy_of(inputs.set, work, "in")
    full = moe_ckpt.load_full(str(source / "checkpoint_last.pt"))
    pruned = prune_state_of(full, str(statistics_of(source)), keep=3, fraction=None, ratio=0.5)
    (work / "pruned").mkdir()
    save_set(pruned, str(work / "pruned" / "ck"), 1)
    (work / "hf").mkdir()
    return ["export-hf", work / "pruned" / "ck.pt", work / "hf"], [work / "pruned", work / "hf"]


def generate_with_groups(content: bytes, output="stats.json", a_directory=False) -> Make:
    """fairseq-generate --moe-routing-stats work/OUTPUT --moe-routing-stats-groups work/groups.txt (``content``)
    on a copy of the 1-process run (OUTPUT an existing directory if ``a_directory``); neither directory may change."""

    def make(inputs, work):
        directory = copy_of(inputs.single, work)
        (work / "groups.txt").write_bytes(content)
        if a_directory:
            (work / output).mkdir()
        flags = ["--moe-routing-stats", str(work / output), "--moe-routing-stats-groups", str(work / "groups.txt")]
        return [*generate_args(inputs.data, directory / "checkpoint_last.pt"), *flags], [directory, work]

    return make


def groups(lines: int) -> bytes:
    return "".join(f"g{i % 3}\n" for i in range(lines)).encode()


def validate_two_subsets_with_groups(inputs, work):
    (work / "groups.txt").write_bytes(groups(SPLITS["valid"]))
    flags = ["--valid-subset", "valid,test", "--moe-routing-stats", str(work / "s.json")]
    flags += ["--moe-routing-stats-groups", str(work / "groups.txt")]
    args = [str(inputs.data), "--user-dir", USER_DIR, "--cpu", "--task", "translation", "--path", str(work / "a.pt")]
    return [*args, *flags], [work]


validate_two_subsets_with_groups.needs_checkpoints = False


def train_with_routing_stats(inputs, work):
    return train_args(inputs.data, work / "ck", "--max-update", "1", "--moe-routing-stats", str(work / "s.json")), []


train_with_routing_stats.needs_checkpoints = False

# fmt: off
CASES = [
    Case("prune-to-fewer-experts-than-k", checkpoint_tool, prune("--keep", "1"), "error",
         "--keep 1 keeps fewer experts than the 2 each token is routed to (--moe-top-k)", "keep at least 2"),
    Case("prune-to-more-experts-than-there-are", checkpoint_tool, prune("--keep", "5"), "error",
         "--keep 5 keeps more experts than the 4 each MoE layer has", "keep 1..4"),
    Case("prune-with-statistics-of-another-model", checkpoint_tool, prune("--keep", "2", stats=other_layers), "error",
         "counts another model: its MoE layers and expert counts", "count the routing of this checkpoint with "
         "fairseq-generate or fairseq-validate --moe-routing-stats"),
    Case("prune-with-statistics-of-another-checkpoint", checkpoint_tool,
         prune("--keep", "2", stats=lambda d: statistics_of(d, set_id="0123456789abcdef")), "error",
         "counts another checkpoint: its set_id is 0123456789abcdef", "count the routing of this checkpoint"),
    Case("prune-for-an-unknown-group", checkpoint_tool, prune("--keep", "2", "--group", "zz"), "error",
         "--group zz is not a key of the statistics", "use one of ['a', 'b'], or drop --group"),
    Case("prune-onto-a-set-of-the-same-name", checkpoint_tool, prune("--keep", "2", existing="set"), "error",
         "exists", "choose another output name (nothing was overwritten)"),
    Case("prune-to-a-world-size-not-dividing-the-experts-kept", checkpoint_tool,
         prune("--keep", "3", "--world-size", "2"), "error",
         "--world-size 2 does not divide the 3 experts kept", "use one of [1, 3]"),
    # -- per-side budgets (prune --encoder-decoder-ratio) and the per-side expert counts they write
    Case("prune-with-an-encoder-decoder-ratio-of-zero", checkpoint_tool,
         prune("--keep", "2", "--encoder-decoder-ratio", "0"), "error",
         "--encoder-decoder-ratio 0 must be a number > 0", "e.g. 3 (Koishekenov et al.'s best on NLLB-200) or 0.5"),
    Case("prune-with-a-ratio-leaving-the-decoder-fewer-experts-than-k", checkpoint_tool,
         prune("--keep", "2", "--encoder-decoder-ratio", "3"), "error",
         "keeps 1 per decoder MoE layer, fewer than the 2 each token is routed to (--moe-top-k)",
         "the splits encoder:decoder this budget allows are 2:2 (R 1); use a ratio near one of them"),
    Case("prune-with-a-ratio-leaving-the-encoder-more-experts-than-it-has", checkpoint_tool,
         prune("--keep", "4", "--encoder-decoder-ratio", "3"), "error",
         "keeps 6 per encoder MoE layer, more than its 4", "the splits encoder:decoder this budget allows are 4:4"),
    Case("export-hf-of-a-set-with-unequal-sides", checkpoint_tool, export_unequal_sides, "error",
         "has --encoder-moe-expert-count 2 and --decoder-moe-expert-count 4: NllbMoe has one num_experts",
         "export a set with the same number of experts on both sides (prune without --encoder-decoder-ratio)"),
    Case("top-k-above-a-side-s-expert-count", fairseq_train, fresh_training("--decoder-moe-expert-count", "1"), TRAIN,
         "--moe-top-k 2 exceeds --decoder-moe-expert-count 1", "use --moe-top-k <= 1"),
    Case("expert-parallel-size-not-dividing-a-side-s-experts", two_workers,
         fresh_training("--encoder-moe-expert-count", "3", "--moe-expert-parallel-size", "2"), LAUNCHED_TRAIN,
         "--moe-expert-parallel-size 2 does not divide --encoder-moe-expert-count 3",
         "use a P dividing both 2 and --encoder-moe-expert-count 3 and --moe-expert-count 4 (1)"),
    Case("routing-statistics-with-fewer-group-lines-than-sentences", fairseq_generate, generate_with_groups(groups(2)),
         GENERATE, f"groups.txt has 2 lines, but the sentences of test number {SPLITS['test']}",
         "give one key per line of the subset, in the order of its sentence ids"),
    Case("routing-statistics-with-more-group-lines-than-sentences", fairseq_generate,
         generate_with_groups(groups(SPLITS["test"] + 1)), GENERATE,
         f"groups.txt has {SPLITS['test'] + 1} lines, but the sentences of test number {SPLITS['test']}",
         "give one key per line of the subset, in the order of its sentence ids"),
    Case("routing-statistics-groups-saved-in-latin-1", fairseq_generate,
         generate_with_groups(groups(4) + "caf\u00e9\n".encode("latin-1")), GENERATE,
         "--moe-routing-stats-groups", "is not UTF-8 text (byte 0xe9 on line 5): save it as UTF-8"),
    Case("routing-statistics-groups-with-an-empty-line", fairseq_generate, generate_with_groups(b"a\n\nb\n"), GENERATE,
         "groups.txt: line 2 holds no key", "give one key per line of the subset"),
    Case("routing-statistics-into-an-existing-directory", fairseq_generate,
         generate_with_groups(groups(SPLITS["test"]), output="stats", a_directory=True), GENERATE,
         "cannot write --moe-routing-stats", "stats is a directory; name a file inside it"),
    Case("routing-statistics-into-a-missing-directory", fairseq_generate,
         generate_with_groups(groups(SPLITS["test"]), output="missing/stats.json"), GENERATE,
         "missing does not exist", "create it first, or choose another output name (nothing was written)"),
    Case("routing-statistics-onto-the-checkpoint-counted", fairseq_generate,
         generate_with_groups(groups(SPLITS["test"]), output="ck/checkpoint_last.pt"), GENERATE,
         "checkpoint_last.pt exists and holds no routing statistics, which the file would replace",
         "choose a new file name (nothing was written)"),
    Case("routing-statistics-groups-for-two-validation-subsets", refused_by("validate"),
         validate_two_subsets_with_groups, "validate.py: error",
         "--moe-routing-stats-groups labels the sentences of one subset by their ids, and --valid-subset valid,test "
         "names 2", "count each subset in a run of its own"),
    Case("routing-statistics-in-training", fairseq_train, train_with_routing_stats, TRAIN,
         "--moe-routing-stats counts the sentences of a subset", "use it with fairseq-generate or fairseq-validate"),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_fails_in_one_line_naming_problem_and_fix_and_changes_no_file(case, started):
    check_case(case, started[case.id])
