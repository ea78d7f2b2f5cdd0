"""The checkpoint tool's output appears whole or not at all, and every command answers bad input
(no checkpoint, a dense one, a missing or unwritable directory, a full disk) with one ``error:``
line; run in process through ``main(argv)`` (tests run as root, where chmod cannot make a directory
read-only, so failing calls are injected; tests/cli/test_disk_full.py fills a real filesystem)."""

import errno
import os

import pytest
import torch

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint import __main__ as tool
from support.inputs.fake_checkpoints import EXPERT_KEY, NOT_CHECKPOINTS, fingerprint, full_state


def run_tool(capsys, *argv):
    code = tool.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


@pytest.mark.parametrize("command", ["inspect", "merge", "reshard"])
@pytest.mark.parametrize("what", NOT_CHECKPOINTS)
def test_a_pt_file_that_holds_no_checkpoint_gets_one_line_from_every_command(tmp_path, capsys, command, what):
    torch.save(NOT_CHECKPOINTS[what], tmp_path / "checkpoint_last.pt")
    (tmp_path / "out").mkdir()
    extra = {
        "inspect": [],
        "merge": [tmp_path / "out" / "m.pt"],
        "reshard": [tmp_path / "out" / "r.pt", "--world-size", "2"],
    }
    code, _, err = run_tool(capsys, command, tmp_path / "checkpoint_last.pt", *extra[command])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and "checkpoint_last.pt is not a fairseq checkpoint: it holds a" in err[0]
    assert "point --path / --restore-file (or the checkpoint tool) at a checkpoint written by fairseq-train" in err[0]
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("command", [["merge"], ["reshard", "--world-size", "2"]], ids=["merge", "reshard"])
def test_writing_into_a_missing_directory_is_refused_in_one_line_and_creates_nothing(a_set, tmp_path, capsys, command):
    out = tmp_path / "missing" / "checkpoint_last.pt"
    code, _, err = run_tool(capsys, command[0], a_set / "checkpoint_last.pt", out, *command[1:])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: cannot write"), err
    assert f"the output directory {tmp_path / 'missing'} does not exist; create it first" in err[0]
    assert not (tmp_path / "missing").exists()


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def permission_denied(*args, **kwargs):
    """What creating anything in a read-only directory raises (tests run as root, where chmod does not)."""
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def torch_write_failure(*args, **kwargs):
    """What torch.save to a path raises for a short write: its stream writer's check, no errno."""
    raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")


def torch_write_failure_on_a_full_disk(*args, **kwargs):
    """torch.save to a path on a full filesystem: the same check, and the filesystem has no block left."""
    os.statvfs = lambda path: os.statvfs_result((4096, 4096, 64, 0, 0, 100, 90, 90, 4096, 255))
    torch_write_failure()


def torch_write_failure_keeping_the_errno(*args, **kwargs):
    """torch.save to a Python file on a full disk: the stream writer's check, the OSError as its context."""
    try:
        enospc()
    except OSError:
        torch_write_failure()


def part_way(failure):
    """torch.save failing on the command's last file, which it leaves half-written (the disk fills up
    part-way: for reshard after rank 0's file, for merge in its only file)."""

    def make(files_before_the_failure):
        real_save, calls = torch.save, []

        def save(obj, path, *args, **kwargs):
            calls.append(path)
            if len(calls) > files_before_the_failure:
                with open(path, "wb") as f:
                    f.write(b"PK\x03\x04 half")
                failure()
            return real_save(obj, path, *args, **kwargs)

        return save

    return make


def always(failure):
    return lambda files_before_the_failure: failure


FULL = ("no space left on device on the filesystem that holds", "free space there, then rerun (nothing was written)")
# (id, what fails, how, the problem the line names, its fix)
# fmt: off
FAILURES = [
    ("read-only-directory", "tempfile.mkdtemp", always(permission_denied), "is not writable (permission denied)",
     "choose an output directory you can write to, then rerun (nothing was written)"),
    ("disk-full-in-torch-save", "torch.save", part_way(enospc), *FULL),
    ("disk-full-as-torch-reports-it-for-a-file", "torch.save", part_way(torch_write_failure_keeping_the_errno), *FULL),
    ("disk-full-as-torch-reports-it-for-a-path", "torch.save", part_way(torch_write_failure_on_a_full_disk), *FULL),
    ("torch-reports-a-failed-write-on-a-disk-with-room", "torch.save", part_way(torch_write_failure),
     "([enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0)",
     "check that filesystem (its free space, its health), then rerun (nothing was written)"),
    ("disk-full-writing-the-manifest", "json.dump", always(enospc), *FULL),
]
# fmt: on


# fmt: off
WRITE_FAILURES = [pytest.param(command, *failure, id=f"{failure[0]}-{command[0]}")
                  for command in (["merge"], ["reshard", "--world-size", "2"]) for failure in FAILURES
                  if not (command == ["merge"] and failure[1] == "json.dump")]  # merge writes no manifest
# fmt: on


@pytest.mark.parametrize("command, failure_id, target, failure, problem, fix", WRITE_FAILURES)
def test_a_failed_write_says_why_in_one_line_leaves_the_output_as_found_and_reruns(
    a_set, tmp_path, capsys, monkeypatch, command, failure_id, target, failure, problem, fix
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "unrelated.txt").write_text("kept")
    before = fingerprint(out)
    with monkeypatch.context() as patched:
        patched.setattr(os, "statvfs", os.statvfs)  # put back by the context, should the failure replace it
        patched.setattr(target, failure(files_before_the_failure=0 if command == ["merge"] else 1))
        code, _, err = run_tool(
            capsys, command[0], a_set / "checkpoint_last.pt", out / "checkpoint_last.pt", *command[1:]
        )
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: cannot write ") and problem in err[0] and fix in err[0], err
    assert fingerprint(out) == before
    code, _, err = run_tool(capsys, command[0], a_set / "checkpoint_last.pt", out / "checkpoint_last.pt", *command[1:])
    assert code == 0, err
    assert torch.equal(
        moe_ckpt.load_full(str(out / "checkpoint_last.pt"))["model"][EXPERT_KEY], full_state()["model"][EXPERT_KEY]
    )


@pytest.mark.parametrize("command", [["merge"], ["reshard", "--world-size", "2"]], ids=["merge", "reshard"])
@pytest.mark.parametrize("depth", [["out.pt"], ["sub", "out.pt"]], ids=["parent", "grandparent"])
def test_an_output_under_a_regular_file_is_reported_as_a_file_not_as_a_missing_directory(
    a_set, tmp_path, capsys, command, depth
):
    (tmp_path / "notes.txt").write_text("a file")
    out = tmp_path.joinpath("notes.txt", *depth)
    code, _, err = run_tool(capsys, command[0], a_set / "checkpoint_last.pt", out, *command[1:])
    assert code == 2 and len(err) == 1, err
    assert f"{tmp_path / 'notes.txt'} is a file, not a directory; choose an output name inside a directory" in err[0]
    assert (tmp_path / "notes.txt").read_text() == "a file"


def test_a_set_whose_move_into_place_fails_half_way_is_taken_back_whole(a_set, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith(".set.json") and os.path.dirname(str(dst)) == str(out):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    code, _, err = run_tool(
        capsys, "reshard", a_set / "checkpoint_last.pt", out / "checkpoint_last.pt", "--world-size", "2"
    )
    assert code == 2 and len(err) == 1 and "Input/output error" in err[0], err
    assert not list(out.iterdir())


@pytest.mark.parametrize("command", [["merge"], ["reshard", "--world-size", "2"]], ids=["merge", "reshard"])
def test_merging_or_resharding_a_dense_checkpoint_says_it_is_dense_and_writes_nothing(tmp_path, capsys, command):
    torch.save({k: v for k, v in full_state().items() if k != "moe"}, tmp_path / "checkpoint_best.pt")
    (tmp_path / "out").mkdir()
    code, _, err = run_tool(
        capsys, command[0], tmp_path / "checkpoint_best.pt", tmp_path / "out" / "c.pt", *command[1:]
    )
    assert code == 2 and len(err) == 1, err
    assert "checkpoint_best.pt is a dense fairseq checkpoint (no MoE layers): there are no experts to merge" in err[0]
    assert not list((tmp_path / "out").iterdir())


def test_inspect_of_an_untrained_set_finds_experts_with_zero_biases_distinct(tmp_path, capsys):
    """A freshly initialised (or imported) model's expert biases are all zero; only equal weights mean
    experts broadcast, all-reduced or seeded alike."""
    state = full_state(updates=0)
    bias = EXPERT_KEY.replace("batched_fc1_w", "batched_fc1_b")
    state["model"][bias] = torch.zeros(4, 2)
    names = ["encoder.embed_tokens.weight", EXPERT_KEY, bias]
    state["moe"] = moe_ckpt.moe_metadata(names, [EXPERT_KEY, bias], 1, 0, 0, experts_per_worker=4)
    state["last_optimizer_state"] = {"state": {}, "param_groups": [{"params": [0, 1, 2]}]}
    moe_ckpt.save_set(state, str(tmp_path / "checkpoint_last"), 2)
    code, out, _ = run_tool(capsys, "inspect", tmp_path / "checkpoint_last.pt")
    assert code == 0 and "VERDICT PROBLEM" not in out, out
    assert "VERDICT OK: every expert is distinct (weights compared; biases start at zero)" in out

    state["model"][EXPERT_KEY][3] = state["model"][EXPERT_KEY][0]  # weights broadcast: still found
    moe_ckpt.save_set(state, str(tmp_path / "copied"), 2)
    code, out, _ = run_tool(capsys, "inspect", tmp_path / "copied.pt")
    assert code == 1 and f"VERDICT PROBLEM: {EXPERT_KEY}: expert 0 of rank 0 equals expert 1 of rank 1" in out, out


# Every writing command, its input absent: a tool that read its input before checking its output would say so.
# fmt: off
WRITERS = {
    "merge": lambda absent, out: ["merge", absent / "ck.pt", out / "ck.pt"],
    "reshard": lambda absent, out: ["reshard", absent / "ck.pt", out / "ck.pt", "--world-size", "2"],
    "upcycle": lambda absent, out: ["upcycle", absent / "ck.pt", out / "ck.pt", "--moe-expert-count", "4"],
    "prune": lambda absent, out: ["prune", absent / "ck.pt", out / "ck.pt", "--stats", absent / "s.json", "--keep", "2"],
    "import-hf": lambda absent, out: ["import-hf", absent, out / "ck.pt"],
    "import-fairseq-moe": lambda absent, out: ["import-fairseq-moe", absent / "ck", out / "ck.pt"],
    "export-hf": lambda absent, out: ["export-hf", absent / "ck.pt", out / "hf"],
}
UNWRITABLE = {  # how the output's directory fails: (made how, the problem the line names)
    "missing": (None, "does not exist; create it first, or choose another output name (nothing was written)"),
    "read-only": (("tempfile.mkdtemp", permission_denied), "is not writable (permission denied)"),
    "full": (("fairseq_moe_ext.checkpoint.staging.filesystem_is_full", lambda directory: True), FULL[0]),
}
# fmt: on


@pytest.mark.parametrize("unwritable", sorted(UNWRITABLE))
@pytest.mark.parametrize("command", sorted(WRITERS))
def test_an_output_that_cannot_be_written_is_refused_before_the_input_is_read(
    tmp_path, capsys, monkeypatch, command, unwritable
):
    made, problem = UNWRITABLE[unwritable]
    out = tmp_path / ("missing" if made is None else "out")
    if made is not None:
        out.mkdir()
        monkeypatch.setattr(*made)
    code, _, err = run_tool(capsys, *WRITERS[command](tmp_path / "absent", out))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: cannot write ") and problem in err[0], err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if made is None else ["out"])
    assert made is None or not list(out.iterdir())
