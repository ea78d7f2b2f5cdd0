"""A full disk is reported as a full disk, by every writer, on a real filesystem that fills up.

Each test mounts a small tmpfs (``mount -t tmpfs -o size=...``: the suite runs as root here; where
mounting is impossible the tests skip and say why, and the injected full-disk cases of
tests/checkpoint/test_checkpoint_tool_output.py and test_write_failure_* below still run). On it: the checkpoint
tool's merge, reshard and upcycle through the real command line, fairseq-train's save through the
plugin, the save's copy step in process, and fairseq-generate's --moe-routing-stats (refused before any work). Each failure must be one line saying "no space left on
device" with the one fix (free space there), leave the directory as it was (names, contents and the
filesystem's free blocks: nothing half-written stays behind), and, once there is room, the same
command must succeed.
"""

import errno
import hashlib
import os
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.fairseq_integration import saving
from support.inputs.fake_checkpoints import EXPERT_KEY, full_state
from support.launch.bad_input_runner import last_error_line, train_args
from support.launch.fairseq_helpers import USER_DIR, run_checkpoint_tool, run_fairseq, tail

FULL = "no space left on device on the filesystem that holds"


@pytest.fixture
def small_filesystem(tmp_path):
    """``mount(name, size)``: a tmpfs of ``size`` at tmp_path/name; ``resize(point, size)``."""
    mounted = []

    def mount(name, size):
        point = tmp_path / name
        point.mkdir()
        why = "the tests do not run as root" if os.geteuid() != 0 else None
        if why is None:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True, text=True
            )
            why = None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")
        if why is not None:
            pytest.skip(
                f"cannot mount a {size} tmpfs to fill up ({why}); mounting needs root or CAP_SYS_ADMIN. "
                f"The injected full-disk cases still run"
            )
        mounted.append(point)
        return point

    def resize(point, size):
        subprocess.run(["mount", "-o", f"remount,size={size}", str(point)], check=True)

    yield Namespace(mount=mount, resize=resize)
    for point in reversed(mounted):
        if subprocess.run(["umount", str(point)]).returncode != 0:
            subprocess.run(["umount", "-l", str(point)])


def snapshot(directory: Path):
    """Every file's sha256 and the filesystem's free blocks: what a failed write must leave as found."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}
    return files, os.statvfs(directory).f_bfree


def checkpoint_tool(*args, expect_failure):
    done = run_checkpoint_tool(*args)
    assert (done.returncode != 0) == expect_failure, f"{done.returncode}\n{tail(done.stdout)}\n{tail(done.stderr)}"
    return [line for line in done.stderr.strip().splitlines() if not line.startswith("INFO:")]  # fairseq's import notes


def a_two_megabyte_set(directory: Path) -> Path:
    """A 2-worker set whose shared part alone (2 MiB) does not fit a 1 MiB filesystem."""
    state = full_state()
    state["model"]["encoder.embed_tokens.weight"] = torch.randn(4096, 128)
    directory.mkdir()
    moe_ckpt.save_set(state, str(directory / "checkpoint_last"), 2)
    return directory / "checkpoint_last.pt"


def a_dense_checkpoint(directory: Path) -> Path:
    """A dense fairseq transformer checkpoint (2+2 layers, FFN 128 -> 512) whose upcycled form, four
    copies of its MoE layers' FFNs, is about 4 MiB."""
    g = torch.Generator().manual_seed(0)
    model = {}
    for side in ("encoder", "decoder"):
        for i in range(2):
            prefix = f"{side}.layers.{i}"
            model.update(
                {
                    f"{prefix}.fc1.weight": torch.randn(512, 128, generator=g),
                    f"{prefix}.fc1.bias": torch.randn(512, generator=g),
                    f"{prefix}.fc2.weight": torch.randn(128, 512, generator=g),
                    f"{prefix}.fc2.bias": torch.randn(128, generator=g),
                }
            )
    cfg = {
        "model": {
            "_name": "transformer",
            "arch": "transformer",
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_ffn_embed_dim": 512,
            "decoder_ffn_embed_dim": 512,
        },
        "criterion": {"_name": "label_smoothed_cross_entropy", "label_smoothing": 0.1},
    }
    directory.mkdir()
    path = directory / "checkpoint_best.pt"
    torch.save({"model": model, "cfg": cfg, "optimizer_history": [{"num_updates": 9}], "extra_state": {}}, path)
    return path


# fmt: off
COMMANDS = {
    "merge": lambda src, dense, out: ["merge", src, out],
    "reshard": lambda src, dense, out: ["reshard", src, out, "--world-size", "2"],
    "upcycle": lambda src, dense, out: ["upcycle", dense, out, "--moe-expert-count", "4", "--moe-freq", "2"],
}
# fmt: on


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_checkpoint_tool_on_a_full_disk_says_so_writes_nothing_and_reruns_later(
    small_filesystem, tmp_path, command
):
    source, dense = a_two_megabyte_set(tmp_path / "set"), a_dense_checkpoint(tmp_path / "dense")
    out_dir = small_filesystem.mount("out", "1m")
    (out_dir / "unrelated.txt").write_text("kept")
    before = snapshot(out_dir)
    args = COMMANDS[command](source, dense, out_dir / "checkpoint_last.pt")
    err = checkpoint_tool(*args, expect_failure=True)
    assert len(err) == 1, err
    assert (
        err[0].startswith("error: cannot write ")
        and f"{FULL} {out_dir}; free space there, then rerun (nothing was written)" in err[0]
    ), err[0]
    assert snapshot(out_dir) == before
    small_filesystem.resize(out_dir, "16m")  # room made
    checkpoint_tool(*args, expect_failure=False)
    written = moe_ckpt.load_full(str(out_dir / "checkpoint_last.pt"))
    if command != "upcycle":
        assert torch.equal(written["model"][EXPERT_KEY], full_state()["model"][EXPERT_KEY])


@pytest.mark.slow
def test_fairseq_train_on_a_full_save_dir_says_no_space_left_and_keeps_its_checkpoint(small_filesystem, parallel_data):
    """A run saves at update 1 (checkpoint_best and checkpoint_last, about 3.4 MB each); the
    filesystem then keeps about 1.2 MB free, and the resumed run's save at update 2 cannot fit."""
    save_dir = small_filesystem.mount("ck", "12m")
    run_fairseq("train", *train_args(parallel_data, save_dir, "--max-update", "1"), timeout=300)
    used_kb = sum(p.stat().st_size for p in save_dir.iterdir()) // 1024
    small_filesystem.resize(save_dir, f"{used_kb + 1200}k")
    before = snapshot(save_dir)
    output = run_fairseq(
        "train", *train_args(parallel_data, save_dir, "--max-update", "2"), timeout=300, expect_failure=True
    )
    line, following = last_error_line(output)
    assert line == (
        f"train.py: error: cannot write the checkpoint of update 2: {FULL} "
        f"{save_dir}; free space there, then rerun the same command (it resumes from the last checkpoint saved whole; "
        f"the half-written files of this save were removed)"
    ), f"{line}\n{tail(output)}"
    assert snapshot(save_dir) == before  # no .tmp, checkpoint_last and checkpoint_best as they were
    moe_ckpt.check_file_intact(str(save_dir / "checkpoint_last.pt"))


def fill(directory: Path) -> None:
    """Write into ``directory`` until its filesystem has no block left."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


@pytest.mark.slow
def test_routing_statistics_onto_a_full_disk_are_refused_before_the_model_is_loaded(small_filesystem, parallel_data):
    """fairseq-generate --moe-routing-stats on a full filesystem: one line while the command line is parsed (the
    --path it names does not exist: a refusal after parsing would be about that), nothing written."""
    out_dir = small_filesystem.mount("stats", "1m")
    fill(out_dir)
    before = snapshot(out_dir)
    stats = out_dir / "stats.json"
    args = [
        parallel_data,
        "--user-dir",
        USER_DIR,
        "--cpu",
        "--path",
        out_dir / "absent.pt",
        "--moe-routing-stats",
        stats,
    ]
    output = run_fairseq("generate", *args, expect_failure=True, expect_status=2)
    line, _ = last_error_line(output)
    assert line == (
        f"generate.py: error: cannot write --moe-routing-stats {stats}: {FULL} {out_dir}; free space there, then "
        f"rerun (nothing was written)"
    ), f"{line}\n{tail(output)}"
    assert snapshot(out_dir) == before


class FakeTrainer:
    """What the save hook reads of fairseq's Trainer, for a dense model saved by one process."""

    data_parallel_rank, checkpoint_suffix, should_save_checkpoint_on_current_rank = 0, "", True
    _model = torch.nn.Linear(2, 2)

    def get_num_updates(self):
        return 7


def fairseqs_save(best: Path, last: Path, size: int):
    """fairseq's save_checkpoint, as far as the files go: checkpoint_best written by rename, then
    copied to checkpoint_last with PathManager.copy, which fairseq asserts on."""
    from fairseq import checkpoint_utils

    def save(cfg, trainer, epoch_itr, val_loss):
        checkpoint_utils.torch_persistent_save({"model": {"w": torch.zeros(size // 4)}}, str(best))
        copied = checkpoint_utils.PathManager.copy(str(best), str(last), overwrite=True)
        assert copied, f"Failed to copy {best} to {last}"

    return save


def test_a_full_disk_while_copying_to_checkpoint_last_keeps_the_old_checkpoint_last(small_filesystem):
    """fairseq copies in place (open, truncate, write): a full disk used to leave a truncated
    checkpoint_last. The hook copies to a temporary name and renames, so the old one stays."""
    save_dir = small_filesystem.mount("ck", "4m")
    last = save_dir / "checkpoint_last.pt"
    torch.save({"model": {"w": torch.ones(250_000)}}, last)  # 1 MB, the previous save's
    old = hashlib.sha256(last.read_bytes()).hexdigest()
    save = saving.wrap_save_checkpoint(fairseqs_save(save_dir / "checkpoint_best.pt", last, 2_000_000))
    with pytest.raises(moe_ckpt.CheckpointWriteError) as refused:
        save(Namespace(no_save=False, save_dir=str(save_dir)), FakeTrainer(), None, None)
    assert str(refused.value).startswith(f"cannot write the checkpoint of update 7: {FULL} {save_dir}; free space")
    assert hashlib.sha256(last.read_bytes()).hexdigest() == old
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint_best.pt", "checkpoint_last.pt"]  # no .tmp
    moe_ckpt.check_file_intact(str(save_dir / "checkpoint_best.pt"))  # written whole before the copy failed


@pytest.mark.parametrize(
    "failure", ["enospc-in-torch-save", "torch-writer-check-on-a-full-disk", "iopath-copy-returns-false-on-a-full-disk"]
)
def test_write_failure_injected_into_a_training_save_is_one_line_and_leaves_no_tmp_file(tmp_path, monkeypatch, failure):
    """The same report without a mount: the failures a full disk causes, injected where they arise."""
    from fairseq import checkpoint_utils

    best, last = tmp_path / "checkpoint_best.pt", tmp_path / "checkpoint_last.pt"
    last.write_bytes(b"the previous checkpoint_last")
    full_disk = os.statvfs_result((4096, 4096, 64, 0, 0, 100, 90, 90, 4096, 255))

    def half_written_then(error):
        def save(obj, f, *args, **kwargs):
            f.write(b"PK\x03\x04 half")
            raise error

        return save

    if failure == "enospc-in-torch-save":
        monkeypatch.setattr(torch, "save", half_written_then(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    elif failure == "torch-writer-check-on-a-full-disk":
        monkeypatch.setattr(
            torch,
            "save",
            half_written_then(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")),
        )
        monkeypatch.setattr(os, "statvfs", lambda path: full_disk)
    else:

        def copy_as_iopath_does(src, dst, overwrite=False):
            Path(dst).write_bytes(b"half a copy")  # iopath logs the error and returns False
            return False

        monkeypatch.setattr(checkpoint_utils.PathManager, "copy", copy_as_iopath_does)
        monkeypatch.setattr(os, "statvfs", lambda path: full_disk)
    monkeypatch.setattr(checkpoint_utils.time, "sleep", lambda seconds: None)  # fairseq retries torch.save thrice
    save = saving.wrap_save_checkpoint(fairseqs_save(best, last, 64))
    with pytest.raises(moe_ckpt.CheckpointWriteError) as refused:
        save(Namespace(no_save=False, save_dir=str(tmp_path)), FakeTrainer(), None, None)
    assert str(refused.value).startswith(f"cannot write the checkpoint of update 7: {FULL} {tmp_path}; free space")
    assert last.read_bytes() == b"the previous checkpoint_last"
    assert not list(tmp_path.glob("*.tmp"))


def test_a_failure_that_is_not_a_write_passes_through_the_save_hook_unchanged(tmp_path):
    def save(cfg, trainer, epoch_itr, val_loss):
        raise RuntimeError("MoE all-to-all of token rows across 2 workers failed (Connection reset by peer)")

    with pytest.raises(RuntimeError, match="^MoE all-to-all of token rows"):
        saving.wrap_save_checkpoint(save)(Namespace(no_save=False, save_dir=str(tmp_path)), FakeTrainer(), None, None)
