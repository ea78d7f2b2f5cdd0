"""A 2-worker run's checkpoint sets when things go wrong, through the real command-line tools: a damaged
set, no hard links, a stale lock, a set resharded to one worker, stray manifests.

Workers are CPU processes launched with torchrun and talking over gloo, exactly as the README
tells users to launch them.
"""

import json
import shutil
import subprocess
import sys

import pytest

from support.launch.fairseq_helpers import (
    USER_DIR,
    fairseq_env,
    run_fairseq,
    torchrun,
)
from support.launch.multiworker_cli_runs import BIN, moe_args
from support.launch.paths import PROBES

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("two_worker_run")]  # its fixtures: tests/cli/conftest.py


@pytest.mark.parametrize(
    "damage, directory, named",
    [
        ("delete", "ck", False),
        # glob metacharacters in the save dir's name; --restore-file named by the user falls back only on request
        ("truncate", "run[1]", True),
    ],
)
def test_a_damaged_set_is_never_loaded_and_the_newest_complete_set_is_used(
    two_worker_run, data, tmp_path, damage, directory, named
):
    save_dir = tmp_path / directory
    shutil.copytree(two_worker_run["at4"], save_dir)
    shutil.copy(save_dir / "checkpoint_last.set.json", save_dir / "keep.json")
    # An older complete set under another name (as --save-interval-updates would leave).
    for rank in range(2):
        shutil.copy(save_dir / f"checkpoint_last-rank-{rank}-of-2.pt", save_dir / f"checkpoint_1_4-rank-{rank}-of-2.pt")
    manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
    for entry in manifest["files"]:
        entry["name"] = entry["name"].replace("checkpoint_last", "checkpoint_1_4")
    (save_dir / "checkpoint_1_4.set.json").write_text(json.dumps(dict(manifest, name="checkpoint_1_4")))
    (save_dir / "keep.json").unlink()
    victim = save_dir / "checkpoint_last-rank-1-of-2.pt"
    if damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:1000])

    last = str(save_dir / "checkpoint_last.pt")
    generate_args = ["--user-dir", USER_DIR, "--path", last, "--cpu", "--num-workers", "0"]
    refused = run_fairseq("generate", str(data), *generate_args, expect_failure=True)
    assert "generate.py: error: " in refused and ("is missing" in refused or "bytes, the manifest records" in refused)

    restore = ["--restore-file", str(save_dir / "checkpoint_last.pt"), "--moe-restore-fallback"] if named else []
    output = torchrun(2, BIN / "fairseq-train", moe_args(data, save_dir, 5, *restore))
    assert "is unusable" in output and "using the newest complete set" in output and "checkpoint_1_4.set.json" in output
    assert "Loaded checkpoint" in output and "(epoch 1 @ 4 updates)" in output


def test_without_hard_links_a_two_worker_run_resumes_and_every_save_keeps_a_complete_set(
    two_worker_run, data, tmp_path
):
    from fairseq_moe_ext import checkpoint as moe_ckpt
    from fairseq_moe_ext.training.save_dir_lock import LOCK_NAME

    save_dir = tmp_path / "ck"
    shutil.copytree(two_worker_run["at4"], save_dir)
    # Saves at updates 5 and 6: each first keeps the existing sets as .prev, by copying.
    output = torchrun(
        2, PROBES / "fairseq_no_hardlinks_probe.py", moe_args(data, save_dir, 6, "--save-interval-updates", "1")
    )
    assert "loading set" in output and "(epoch 1 @ 4 updates)" in output
    assert (
        "refused hard link" in output
        and f"refused hard link {save_dir}/checkpoint_last.prev-rank-1-of-2.pt.tmp" in output
    )
    assert (
        "copying checkpoint_last-rank-0-of-2.pt to checkpoint_last.prev-rank-0-of-2.pt instead" in output
    )  # rank 0 logs
    for name, updates in (("checkpoint_1_5", 5), ("checkpoint_1_6", 6), ("checkpoint_last", 6)):
        assert moe_ckpt.validate_set(str(save_dir / f"{name}.set.json"))["num_updates"] == updates
    left = sorted(p.name for p in save_dir.iterdir() if ".prev" in p.name or p.name.endswith(".tmp"))
    assert not left, left
    assert not (save_dir / LOCK_NAME).exists()


@pytest.fixture(scope="module")
def one_worker_set_resumed_twice(two_worker_run, data, tmp_path_factory):
    """The 2-worker set resharded to a 1-of-1 set, resumed by 1-process fairseq-train to update 5,
    then again to 6; before the first, the save dir holds the lock of a job that died."""
    from fairseq_moe_ext.training.save_dir_lock import LOCK_NAME, this_job

    save_dir = tmp_path_factory.mktemp("one") / "ck"
    save_dir.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fairseq_moe_ext.checkpoint",
            "reshard",
            two_worker_run["at4"] / "checkpoint_last.pt",
            save_dir / "checkpoint_last.pt",
            "--world-size",
            "1",
        ],
        check=True,
        env=fairseq_env(),
        capture_output=True,
    )
    died = subprocess.Popen([sys.executable, "-c", "pass"])
    died.wait()
    stale = dict(host=this_job().host, pid=died.pid, started="2026-01-01T00:00:00+00:00", job="died")
    (save_dir / LOCK_NAME).write_text(json.dumps(stale))
    first = run_fairseq("train", *moe_args(data, save_dir, 5))
    after_first = sorted(p.name for p in save_dir.iterdir())
    second = run_fairseq("train", *moe_args(data, save_dir, 6))
    return {"save_dir": save_dir, "outputs": (first, second), "after_first": after_first, "stale": stale}


def test_a_set_resharded_to_one_worker_resumes_in_one_process_twice_in_a_row(one_worker_set_resumed_twice):
    first, second = one_worker_set_resumed_twice["outputs"]
    assert "loading set" in first and "checkpoint_last.set.json as worker 0 of 1" in first
    assert "(epoch 1 @ 4 updates)" in first
    assert "loading file" in second and "(epoch 1 @ 5 updates)" in second
    for names in (
        one_worker_set_resumed_twice["after_first"],
        sorted(p.name for p in one_worker_set_resumed_twice["save_dir"].iterdir()),
    ):
        own = [n for n in names if n.startswith("checkpoint_last")]
        assert own == ["checkpoint_last.pt"], names  # one layout: no rank file or manifest beside it


def test_a_stale_lock_of_a_dead_job_is_taken_over_and_a_finished_run_leaves_no_lock(one_worker_set_resumed_twice):
    from fairseq_moe_ext.training.save_dir_lock import LOCK_NAME

    first, _ = one_worker_set_resumed_twice["outputs"]
    assert (
        f"taking over the lock {one_worker_set_resumed_twice['save_dir'] / LOCK_NAME} of job died "
        f"(pid {one_worker_set_resumed_twice['stale']['pid']}" in first
    )
    assert LOCK_NAME not in one_worker_set_resumed_twice["after_first"]
    assert not (one_worker_set_resumed_twice["save_dir"] / LOCK_NAME).exists()


# Files another tool (or a person) left in a save dir: none of them may stop a run or be touched.
# fmt: off
STRAY_MANIFESTS = {
    "another-tools.set.json": '{"foo": 1}',
    "a-list.set.json": "[1, 2, 3]",
    "not-json.set.json": "this is not JSON",
    "stray.prev.set.json": '{"foo": 1}',
}
# fmt: on


def test_stray_manifests_neither_stop_a_two_worker_resume_and_save_nor_are_touched(two_worker_run, data, tmp_path):
    from fairseq_moe_ext import checkpoint as moe_ckpt

    save_dir = tmp_path / "ck"
    shutil.copytree(two_worker_run["at4"], save_dir)
    manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
    # An older complete set to fall back to, so the fallback scans the directory.
    for rank in range(2):
        shutil.copy(save_dir / f"checkpoint_last-rank-{rank}-of-2.pt", save_dir / f"checkpoint_1_4-rank-{rank}-of-2.pt")
    older = dict(
        manifest,
        name="checkpoint_1_4",
        files=[dict(e, name=e["name"].replace("checkpoint_last", "checkpoint_1_4")) for e in manifest["files"]],
    )
    (save_dir / "checkpoint_1_4.set.json").write_text(json.dumps(older))
    (save_dir / "checkpoint_last-rank-1-of-2.pt").unlink()
    for name, text in STRAY_MANIFESTS.items():
        (save_dir / name).write_text(text)
    # Our format, naming a file outside the directory (which exists, and is a valid rank file).
    (tmp_path / "x").mkdir()
    shutil.copy(save_dir / "checkpoint_1_4-rank-1-of-2.pt", tmp_path / "x" / "elsewhere-rank-1-of-2.pt")
    outside = dict(
        older,
        name="elsewhere",
        files=[dict(e, name=f"../x/elsewhere-rank-{e['rank']}-of-2.pt") for e in older["files"]],
    )
    (save_dir / "elsewhere.set.json").write_text(json.dumps(dict(outside, num_updates=99)))
    strays = [*STRAY_MANIFESTS, "elsewhere.set.json"]
    before = {name: (save_dir / name).read_bytes() for name in strays}

    output = torchrun(2, BIN / "fairseq-train", moe_args(data, save_dir, 5))

    assert f"using the newest complete set {save_dir / 'checkpoint_1_4.set.json'}" in output  # not elsewhere's "99"
    assert "(epoch 1 @ 4 updates)" in output
    for name in strays:
        assert (save_dir / name).read_bytes() == before[name], f"{name} was changed"
        assert output.count(f"ignoring {save_dir / name}:") <= 2, f"{name}: more than one warning per worker"
    for name in (n for n in strays if not n.endswith(".prev.set.json")):  # scanned by the fallback on both workers
        assert f"ignoring {save_dir / name}:" in output, name
    saved = moe_ckpt.validate_set(str(save_dir / "checkpoint_last.set.json"))
    assert saved["num_updates"] == 5 and saved["world_size"] == 2
    assert moe_ckpt.load_full(str(save_dir / "checkpoint_last.pt"))["moe"]["num_updates"] == 5
