"""Which checkpoint fairseq-train resumes from when the one it was given is a damaged set.

Checked on the files alone (any bytes serve as rank files); tests/cli/test_bad_input.py and
tests/cli/test_multiworker_cli.py run the same through fairseq-train.
"""

import argparse

import pytest

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.training.restore_choice import resolve_restore

SUFFIX = "-rank-0-of-2"  # what fairseq-train's checkpoint_suffix is on worker 0 of 2


@pytest.fixture
def save_dir(tmp_path):
    """checkpoint_last (update 6) lost rank 1's file; checkpoint_1_4 (update 4) is complete."""
    for name, updates in (("checkpoint_1_4", 4), ("checkpoint_last", 6)):
        base = str(tmp_path / name)
        files = []
        for rank in range(2):
            path = moe_ckpt.rank_file(base, rank, 2)
            with open(path, "wb") as f:
                f.write(b"%s rank %d" % (name.encode(), rank))
            files.append(dict(moe_ckpt.describe_file(path), rank=rank))
        moe_ckpt.write_manifest(base, 2, updates, files, {})
    (tmp_path / "checkpoint_last-rank-1-of-2.pt").unlink()
    return tmp_path


def cfg(save_dir, restore_file="checkpoint_last.pt"):
    return argparse.Namespace(save_dir=str(save_dir), restore_file=restore_file)


def test_fairseqs_default_checkpoint_last_falls_back_to_the_newest_complete_set(save_dir):
    found = resolve_restore(str(save_dir / f"checkpoint_last{SUFFIX}.pt"), cfg(save_dir), SUFFIX, allow_fallback=False)
    assert found.path == str(save_dir / "checkpoint_1_4.set.json") and found.fallback_reason


def test_a_damaged_set_named_by_restore_file_is_refused_in_one_line_naming_the_fallback_flag(save_dir):
    named = str(save_dir / "checkpoint_last.pt")  # spelled out, even as the default's own path
    with pytest.raises(moe_ckpt.CheckpointSetError) as refused:
        resolve_restore(named.replace(".pt", SUFFIX + ".pt"), cfg(save_dir, named), SUFFIX, allow_fallback=False)
    message = str(refused.value)
    assert message.startswith(f"checkpoint set {save_dir / 'checkpoint_last.set.json'} cannot be loaded: rank 1 file")
    assert message.endswith(f"or add --moe-restore-fallback to train from the newest complete set in {save_dir}")
    assert "\n" not in message


def test_moe_restore_fallback_lets_a_named_damaged_set_fall_back(save_dir):
    named = str(save_dir / "checkpoint_last.pt")
    found = resolve_restore(named.replace(".pt", SUFFIX + ".pt"), cfg(save_dir, named), SUFFIX, allow_fallback=True)
    assert found.path == str(save_dir / "checkpoint_1_4.set.json")


def test_a_named_set_resumes_at_another_world_size(save_dir):
    named = str(save_dir / "checkpoint_1_4.pt")
    found = resolve_restore(
        named.replace(".pt", "-rank-3-of-4.pt"), cfg(save_dir, named), "-rank-3-of-4", allow_fallback=False
    )
    assert found.path == str(save_dir / "checkpoint_1_4.set.json") and found.fallback_reason is None
