"""Bad input fails fast with one clear line naming the problem and the fix, and changes no file."""

import hashlib
import shutil
from pathlib import Path

import pytest

from fairseq_helpers import USER_DIR, preprocess_parallel, run_fairseq, write_parallel_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    data = preprocess_parallel(write_parallel_corpus(root / "raw"), root / "bin")
    save_dir = root / "ck"
    run_fairseq("train", *train_args(data, save_dir, "--max-update", "3"))
    return data, save_dir


def train_args(data, save_dir, *extra):
    return [str(data), "--user-dir", USER_DIR, "--cpu", "--arch", "moe_transformer_tiny", "--num-workers", "0",
            "--criterion", "moe_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "1e-3",
            "--max-tokens", "500", "--save-dir", str(save_dir), *extra]


def fingerprint(directory: Path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def error_line(output: str, kind: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(kind + ":")]
    assert lines, output[-3000:]
    return lines[-1]


@pytest.mark.parametrize(
    "extra, kind, message",
    [
        (["--moe-expert-count", "8"], "ValueError", "holds 4 experts in encoder.layers.1.fc1, this model 8: resume with the checkpoint's --moe-expert-count"),
        (["--encoder-embed-dim", "32"], "ValueError", "does not fit this model: encoder.embed_tokens.weight is"),
    ],
)
def test_resuming_with_other_model_flags_names_the_mismatch_and_keeps_the_checkpoint(trained, extra, kind, message):
    data, save_dir = trained
    before = fingerprint(save_dir)
    output = run_fairseq("train", *train_args(data, save_dir, "--max-update", "6", *extra), expect_failure=True)
    assert message in error_line(output, kind)
    assert fingerprint(save_dir) == before


@pytest.mark.parametrize(
    "extra, kind, message",
    [
        (["--moe-top-k", "5"], "ValueError", "--moe-top-k 5 exceeds --moe-expert-count 4: use --moe-top-k <= 4"),
        (["--moe-capacity-factor", "nan"], "ValueError", "--moe-capacity-factor must be a finite number"),
        (["--moe-router", "hash"], "fairseq-train", "invalid choice: 'hash'"),
        (["--moe-expert-count", "0"], "ValueError", "--moe-expert-count must be a positive integer"),
    ],
)
def test_bad_moe_flags_fail_before_anything_is_written(trained, tmp_path, extra, kind, message):
    data, _ = trained
    save_dir = tmp_path / "fresh"
    output = run_fairseq("train", *train_args(data, save_dir, "--max-update", "2", *extra), expect_failure=True)
    assert message in output and (kind == "fairseq-train" or message in error_line(output, kind))
    assert not save_dir.exists() or not any(save_dir.iterdir())


def test_a_name_with_both_a_single_file_and_a_set_is_refused(trained, tmp_path):
    data, save_dir = trained
    mixed = tmp_path / "mixed"
    shutil.copytree(save_dir, mixed)
    (mixed / "checkpoint_last-rank-0-of-2.pt").write_bytes(b"not really")
    before = fingerprint(mixed)
    output = run_fairseq("generate", str(data), "--user-dir", USER_DIR, "--path", str(mixed / "checkpoint_last.pt.missing"),
                         "--cpu", expect_failure=True)
    assert "Model file not found" in output  # a plain missing name stays fairseq's own error
    output = run_fairseq("train", *train_args(data, mixed, "--max-update", "6"), expect_failure=True)
    assert "two layouts for one checkpoint; move one of them away" in error_line(output, "fairseq_moe_ext.checkpoint.CheckpointSetError")
    assert fingerprint(mixed) == before
