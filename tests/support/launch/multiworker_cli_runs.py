"""The MoE training and generation command lines of the multi-worker CLI tests (tests/cli/): one
set of fairseq-train flags, fairseq-generate in one process or on torchrun workers (its hypotheses by
sentence id), the comparison of two generations, and an edit of one rank file of a set."""

import glob
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from support.launch.fairseq_helpers import USER_DIR, run_fairseq, torchrun

BIN = Path(sys.executable).parent


def moe_args(data, save_dir, max_update, *extra, seed=1, max_tokens=300):
    return [
        str(data),
        "--user-dir",
        USER_DIR,
        "--cpu",
        "--seed",
        str(seed),
        "--num-workers",
        "0",
        "--arch",
        "moe_transformer_tiny",
        "--moe-expert-count",
        "4",
        "--criterion",
        "moe_label_smoothed_cross_entropy",
        "--label-smoothing",
        "0.1",
        "--optimizer",
        "adam",
        "--lr",
        "3e-3",
        "--max-tokens",
        str(max_tokens),
        "--clip-norm",
        "1.0",
        "--max-update",
        str(max_update),
        "--save-dir",
        str(save_dir),
        "--log-format",
        "json",
        "--log-interval",
        "1",
        *extra,
    ]


def generate(data, path, workers=1, extra=(), log_dir=None, in_process=True):
    """fairseq-generate's hypotheses ``{sentence id: (score, text)}`` and its output: on ``workers``
    torchrun workers, or in one process. One process is this one (fairseq_cli.generate's own main,
    its output written with --results-path): these tests compare what is generated, and a fresh
    interpreter would add only fairseq's import; ``in_process=False`` runs the real command line
    (tests/cli/test_fairseq_cli.py and test_sharded_inference_cli.py keep it covered)."""
    args = [
        str(data),
        "--user-dir",
        USER_DIR,
        "--path",
        str(path),
        "--cpu",
        "--beam",
        "2",
        "--max-tokens",
        "2000",
        "--num-workers",
        "0",
        *extra,
    ]
    if workers > 1:
        torchrun(workers, BIN / "fairseq-generate", args, log_dir=log_dir)
        output = "\n".join(Path(p).read_text() for p in glob.glob(f"{log_dir}/**/stdout.log", recursive=True))
    elif in_process:
        output = generate_in_process(args)
    else:
        output = run_fairseq("generate", *args)
    hypotheses = {
        i: (float(score), text) for i, score, text in re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", output, flags=re.M)
    }
    return hypotheses, output


def generate_in_process(args):
    """fairseq_cli.generate.main on ``args`` in this process; returns what it wrote (hypotheses and
    the BLEU line) to its --results-path file."""
    import tempfile

    from fairseq_cli import generate as generate_cli

    from fairseq import options

    with tempfile.TemporaryDirectory() as results:
        parsed = options.parse_args_and_arch(options.get_generation_parser(), [*args, "--results-path", results])
        generate_cli.main(parsed)
        return "\n".join(Path(p).read_text() for p in sorted(glob.glob(f"{results}/generate-*.txt")))


def assert_same_generation(got, want):
    assert got.keys() == want.keys() and len(want) > 10
    for i, (score, text) in want.items():
        assert got[i][1] == text, (i, got[i], want[i])
        assert got[i][0] == pytest.approx(score, abs=1e-4), (i, got[i], want[i])


def rewrite_rank_file(save_dir, rank, edit):
    """Edit rank ``rank``'s file of a 2-worker set in place and update its entry in the manifest, so
    that the set still validates (what is left to find is what ``edit`` changed)."""
    from fairseq_moe_ext import checkpoint as moe_ckpt

    path = save_dir / f"checkpoint_last-rank-{rank}-of-2.pt"
    state = moe_ckpt.safe_load(str(path))
    edit(state)
    torch.save(state, path)
    manifest_file = save_dir / "checkpoint_last.set.json"
    manifest = json.loads(manifest_file.read_text())
    for entry in manifest["files"]:
        if entry["rank"] == rank:
            entry.update(moe_ckpt.describe_file(str(path)))
    manifest_file.write_text(json.dumps(manifest))
