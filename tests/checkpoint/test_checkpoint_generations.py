"""The previous generation of a set (``<name>.prev``) that keeps a save's crash from losing it.

Checked on the files alone (any bytes serve as rank files: the manifest records size and sha256),
on filesystems with hard links and (``os.link`` made to fail) without them;
tests/cli/test_fault_injection.py checks the same promises through killed fairseq-train jobs.
"""

import errno
import os

import pytest

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint import keep_copy

WORLD = 2


def write_set(directory, name, contents, num_updates):
    base = str(directory / name)
    files = []
    for rank, data in enumerate(contents):
        path = moe_ckpt.rank_file(base, rank, WORLD)
        with open(path, "wb") as f:
            f.write(data)
        files.append(dict(moe_ckpt.describe_file(path), rank=rank))
    return moe_ckpt.write_manifest(base, WORLD, num_updates, files, {})


def keep_previous(manifest):
    for rank in range(WORLD):
        moe_ckpt.link_previous_generation(manifest, rank, WORLD)
    moe_ckpt.write_previous_manifest(manifest, WORLD)
    return moe_ckpt.manifest_path(moe_ckpt.base_of(manifest) + moe_ckpt.PREVIOUS)


def overwrite(path, data):
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(data)
    moe_ckpt.os.replace(tmp, path)


def test_the_previous_generation_keeps_the_old_bytes_when_the_set_is_overwritten(tmp_path):
    manifest = write_set(tmp_path, "checkpoint_last", [b"old rank 0", b"old rank 1"], 10)
    previous = keep_previous(manifest)
    overwrite(moe_ckpt.rank_file(str(tmp_path / "checkpoint_last"), 0, WORLD), b"new rank 0 bytes")

    assert moe_ckpt.validate_set(previous)["num_updates"] == 10
    with pytest.raises(moe_ckpt.CheckpointSetError):
        moe_ckpt.validate_set(manifest)
    assert [m["num_updates"] for m in moe_ckpt.complete_sets(str(tmp_path))] == [10]


def test_every_set_is_protected_before_a_save_when_no_save_was_interrupted(tmp_path):
    sets = [write_set(tmp_path, name, [b"a", b"b"], n) for name, n in (("checkpoint_1_4", 4), ("checkpoint_last", 4))]
    assert sorted(moe_ckpt.sets_to_protect(str(tmp_path))) == sorted(sets)


def test_a_damaged_set_never_replaces_an_intact_previous_generation(tmp_path):
    manifest = write_set(tmp_path, "checkpoint_last", [b"old rank 0", b"old rank 1"], 10)
    previous = keep_previous(manifest)
    # the crash: rank 0 had written its new file, rank 1 had not, no new manifest
    overwrite(moe_ckpt.rank_file(str(tmp_path / "checkpoint_last"), 0, WORLD), b"new rank 0 bytes")

    assert moe_ckpt.sets_to_protect(str(tmp_path)) == []  # the restarted job's next save links nothing over it
    assert moe_ckpt.validate_set(previous)["num_updates"] == 10


def test_an_intact_set_is_protected_again_over_a_stale_previous_generation(tmp_path):
    manifest = write_set(tmp_path, "checkpoint_last", [b"old rank 0", b"old rank 1"], 10)
    keep_previous(manifest)
    # the crash came after the new set was complete, before its .prev was dropped
    manifest = write_set(tmp_path, "checkpoint_last", [b"newer rank 0", b"newer rank 1"], 12)

    assert moe_ckpt.sets_to_protect(str(tmp_path)) == [manifest]
    previous = keep_previous(manifest)
    assert moe_ckpt.validate_set(previous)["num_updates"] == 12


def test_relinking_over_a_stale_previous_generation_never_leaves_a_listed_file_missing(tmp_path, monkeypatch):
    manifest = write_set(tmp_path, "checkpoint_last", [b"old rank 0", b"old rank 1"], 10)
    keep_previous(manifest)
    manifest = write_set(tmp_path, "checkpoint_last", [b"newer rank 0", b"newer rank 1"], 12)
    listed = {
        e["name"]
        for e in moe_ckpt.read_manifest(moe_ckpt.manifest_path(moe_ckpt.base_of(manifest) + moe_ckpt.PREVIOUS))["files"]
    }
    removed = []
    real_remove = moe_ckpt.os.remove
    monkeypatch.setattr(moe_ckpt.os, "remove", lambda p: (removed.append(p), real_remove(p)))

    keep_previous(manifest)
    assert not [p for p in removed if p.rsplit("/", 1)[-1] in listed]


def test_protecting_a_set_twice_leaves_no_temporary_link_behind(tmp_path):
    manifest = write_set(tmp_path, "checkpoint_1_4", [b"a", b"b"], 4)
    keep_previous(manifest)
    keep_previous(manifest)  # a save after a crash finds the links of the interrupted one
    assert not list(tmp_path.glob("*.tmp"))
    moe_ckpt.remove_previous_generations(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_1_4-rank-0-of-2.pt",
        "checkpoint_1_4-rank-1-of-2.pt",
        "checkpoint_1_4.set.json",
    ]


def refuse_links(monkeypatch, code):
    def link(source, target):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(keep_copy.os, "link", link)


@pytest.mark.parametrize("code", [errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK])
def test_without_hard_links_the_previous_generation_is_a_copy_of_the_old_bytes(tmp_path, monkeypatch, code):
    manifest = write_set(tmp_path, "checkpoint_last", [b"old rank 0", b"old rank 1"], 10)
    refuse_links(monkeypatch, code)
    previous = keep_previous(manifest)
    keep_previous(manifest)  # the next save of a restarted job copies again over the first copies
    overwrite(moe_ckpt.rank_file(str(tmp_path / "checkpoint_last"), 0, WORLD), b"new rank 0 bytes")

    assert moe_ckpt.validate_set(previous)["num_updates"] == 10
    assert not list(tmp_path.glob("*.tmp"))


def test_a_link_failure_other_than_missing_hard_links_is_raised_not_hidden_by_a_copy(tmp_path, monkeypatch):
    manifest = write_set(tmp_path, "checkpoint_last", [b"old rank 0", b"old rank 1"], 10)
    refuse_links(monkeypatch, errno.ENOSPC)
    with pytest.raises(OSError, match="No space left"):
        moe_ckpt.link_previous_generation(manifest, 0, WORLD)


def test_a_copy_failing_half_way_keeps_the_previous_generation_and_leaves_no_temp_file(tmp_path, monkeypatch):
    manifest = write_set(tmp_path, "checkpoint_last", [b"old rank 0", b"old rank 1"], 10)
    previous = keep_previous(manifest)
    base = str(tmp_path / "checkpoint_last")
    for rank in range(WORLD):  # the next save, renaming its files into place as fairseq does
        overwrite(moe_ckpt.rank_file(base, rank, WORLD), b"newer rank %d" % rank)
    files = [dict(moe_ckpt.describe_file(moe_ckpt.rank_file(base, r, WORLD)), rank=r) for r in range(WORLD)]
    manifest = moe_ckpt.write_manifest(base, WORLD, 12, files, {})
    refuse_links(monkeypatch, errno.EPERM)

    def disk_full_half_way(source, destination, length):
        destination.write(source.read(3))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(keep_copy.shutil, "copyfileobj", disk_full_half_way)
    with pytest.raises(OSError):
        moe_ckpt.link_previous_generation(manifest, 0, WORLD)
    assert moe_ckpt.validate_set(previous)["num_updates"] == 10
    assert not list(tmp_path.glob("*.tmp"))
