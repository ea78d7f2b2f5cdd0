"""A 2-worker fairseq-train job SIGKILLed again and again, restarted each time with the same command.

One seeded chain of trials: each trial kills one worker at a point drawn from the seed (inside an
MoE all-to-all, inside the optimizer step, part-way through writing a checkpoint set, or from
outside at a random moment), then the next trial's job is the restart. Every restart must load
the newest complete checkpoint set on disk (found here independently of the plugin's own code),
lose nothing older than the last completed save, and log exactly the losses of an uninterrupted
run. The last restart runs to the end, and its final state equals the uninterrupted run's, bit for
bit.
"""

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.launch.dist_utils import free_port
from support.launch.fairseq_helpers import fairseq_env, tail, torchrun_command
from support.launch.multiworker_cli_runs import moe_args
from support.launch.paths import PROBES
from support.probes.full_precision_logs import carries_every_digit

pytestmark = pytest.mark.slow
PROBE = PROBES / "fairseq_crash_probe.py"
SEED = 2026
SAVE_EVERY = 2
ALL_TO_ALLS_PER_STEP = 8  # tiny model: 2 MoE layers, each 2 exchanges forward and 2 backward


def train_args(data, save_dir):
    # fmt: off
    return moe_args(
        data, save_dir, LAST_UPDATE,
        "--ddp-backend", "legacy_ddp", "--save-interval-updates", str(SAVE_EVERY), "--keep-interval-updates", "2",
        "--disable-validation", "--distributed-world-size", "2",
        seed=3, max_tokens=64,
    )
    # fmt: on


class Job:
    """One torchrun launch of the probe; each worker's output goes to its own file."""

    def __init__(self, workdir: Path, args, plan: str = ""):
        self.workdir = workdir
        workdir.mkdir(parents=True)
        env = dict(fairseq_env(), PYTHONUNBUFFERED="1", CRASH_PLAN=plan, CRASH_PID_DIR=str(workdir))
        command = torchrun_command(2, free_port(), PROBE, args, workdir / "logs", redirects=3)
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )

    def wait(self, timeout=300) -> int:
        """The launcher's exit code; past ``timeout`` the whole job is killed and the test fails."""
        try:
            self.launcher_output = self.process.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.communicate()
            pytest.fail(f"the job was still running after {timeout} s:\n{tail(self.output(0), 30)}", pytrace=False)
        return self.process.returncode

    def output(self, rank: int) -> str:
        files = sorted(self.workdir.glob(f"logs/*/attempt_0/{rank}/std*.log"))
        return "".join(f.read_text(errors="replace") for f in files)

    def order_violations(self) -> str:
        """What the probe's watcher saw: a checkpoint file removed while a manifest listed it, or
        overwritten with no complete previous generation on disk."""
        return "".join(f.read_text() for f in sorted(self.workdir.glob("order-violations-rank-*")))

    def losses(self):
        """``{update: loss}`` from rank 0's complete json log lines (a killed worker's last line
        may be cut short)."""
        found = {}
        for line in self.output(0).splitlines():
            start = line.find('{"epoch"')
            if start < 0:
                continue
            try:
                record = json.loads(line[start:])
            except ValueError:
                continue
            if "num_updates" in record and "loss" in record:
                found[int(record["num_updates"])] = float(record["loss"])
        return found

    def kill_from_outside(self, rank: int, after_update: int, delay: float, timeout=300):
        """SIGKILL worker ``rank`` ``delay`` seconds after both workers started the step after
        ``after_update`` (so that each has logged what it resumed from, however loaded the machine)."""
        deadline = time.monotonic() + timeout

        def updates_done(worker: int) -> int:  # read once: the worker rewrites the file at every step
            progress = self.workdir / f"updates-rank-{worker}"
            text = progress.read_text().strip() if progress.exists() else ""
            return int(text) if text.isdigit() else -1

        while min(updates_done(0), updates_done(1)) < after_update:
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job ended before update {after_update}:\n{tail(self.output(0), 40)}", pytrace=False)
            time.sleep(0.02)
        time.sleep(delay)
        os.kill(int((self.workdir / f"pid-rank-{rank}").read_text()), signal.SIGKILL)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def newest_complete_update(save_dir: Path) -> int:
    """The most updates of any set whose manifest lists every rank file with its exact bytes (the
    plugin's own validation is not used, so that the two can disagree)."""
    newest = 0
    for manifest_file in save_dir.glob("*.set.json"):
        manifest = json.loads(manifest_file.read_text())
        files = [save_dir / entry["name"] for entry in manifest["files"]]
        if sorted(e["rank"] for e in manifest["files"]) != list(range(manifest["world_size"])):
            continue
        if all(f.exists() and sha256(f) == e["sha256"] for f, e in zip(files, manifest["files"])):
            newest = max(newest, manifest["num_updates"])
    return newest


def loaded_update(output: str) -> int:
    found = re.findall(r"Loaded checkpoint .* \(epoch \d+ @ (\d+) updates\)", output)
    return int(found[-1]) if found else 0


def draw_trials(seed: int):
    """(rank, update, phase) per trial: every kind of kill point once on each rank that it can
    differ on, order and details drawn from ``seed``; kill updates increase so that the chain always
    moves on. Saves differ by rank and by how far the save got (0, 1 or 2 files), so all six
    combinations run; an all-to-all kill is drawn once in the forward and once in the backward
    exchanges, on different ranks; an outside kill at a random moment once per rank."""
    rng = random.Random(seed)
    kinds = [f"save:{n}" for n in (0, 1, 2)] * 2  # both ranks below, each part-way through a save
    kinds += [f"all_to_all:{rng.randrange(ALL_TO_ALLS_PER_STEP // 2)}"]  # forward
    kinds += [f"all_to_all:{rng.randrange(ALL_TO_ALLS_PER_STEP // 2, ALL_TO_ALLS_PER_STEP)}"]  # backward
    kinds += ["optimizer", "external", "external"]
    forward_rank = rng.randrange(2)
    ranks = [0, 0, 0, 1, 1, 1, forward_rank, 1 - forward_rank, rng.randrange(2), 0, 1]
    order = list(range(len(kinds)))
    rng.shuffle(order)
    trials, update = [], 2
    for i in order:
        update += rng.choice([1, 2])
        if kinds[i].startswith("save"):
            update += update % SAVE_EVERY  # saves happen at even updates
        trials.append((ranks[i], update, kinds[i]))
    return trials


TRIALS = draw_trials(SEED)
LAST_UPDATE = TRIALS[-1][1] + 3


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    job = Job(root / "job", train_args(data, root / "ck"))
    assert job.wait() == 0, tail(job.output(0) + job.launcher_output, 60)
    losses = job.losses()
    assert sorted(losses) == list(range(1, LAST_UPDATE + 1)), "all updates within one epoch, each logged"
    assert carries_every_digit(losses.values()), "the probe should log losses unrounded"
    assert "begin training epoch 2" not in job.output(0), "the chain must stay within the first epoch"
    interval_sets = sorted(p.name for p in (root / "ck").glob("checkpoint_1_*.set.json"))
    assert len(interval_sets) == 2, f"--keep-interval-updates 2 pruned the older sets: {interval_sets}"
    assert not job.order_violations(), job.order_violations()
    return {"losses": losses, "save_dir": root / "ck"}


def test_eleven_seeded_sigkills_at_every_kind_of_point_never_lose_a_completed_save(data, uninterrupted, tmp_path):
    from fairseq_moe_ext import checkpoint as moe_ckpt

    save_dir, want = tmp_path / "ck", uninterrupted["losses"]
    rng = random.Random(SEED + 1)
    last_completed = 0  # the newest save known to have completed before the current kill
    for number, (rank, update, phase) in enumerate(TRIALS + [(None, None, None)]):
        plan = "" if phase is None else f"{rank}:{update}:{phase}"
        job = Job(tmp_path / f"job{number}", train_args(data, save_dir), plan)
        if phase == "external":
            job.kill_from_outside(rank, update - 1, delay=rng.uniform(0.0, 0.4))
        code = job.wait()
        what = f"trial {number} {(rank, update, phase)}"
        log = job.output(0) + job.output(1)

        resumed_from = loaded_update(log)
        assert resumed_from == last_completed, (
            f"{what}: resumed from {resumed_from}, newest complete set was {last_completed}"
        )
        losses = job.losses()  # empty when the kill came within the first step
        assert not losses or min(losses) == resumed_from + 1, (
            f"{what}: resumed from {resumed_from}, logged {sorted(losses)}"
        )
        wrong = {u: (loss, want[u]) for u, loss in losses.items() if loss != want[u]}
        assert not wrong, f"{what}: losses differ from the uninterrupted run {wrong}"
        assert not job.order_violations(), f"{what}: {job.order_violations()}"

        if phase is None:
            assert code == 0, tail(log + job.launcher_output, 60)
            break
        assert code != 0, f"{what}: the job survived its kill\n{tail(log, 30)}"
        on_disk = newest_complete_update(save_dir)
        # A kill while producing update u can only lose work after the last save before u.
        saved_before_kill = (update - 1) // SAVE_EVERY * SAVE_EVERY
        assert on_disk >= saved_before_kill, f"{what}: newest complete set on disk is {on_disk}"
        assert on_disk <= update, f"{what}: a set at {on_disk} completed after its kill"
        last_completed = on_disk
        if plan:  # the next job must find exactly this set; check the plugin agrees before it starts
            assert moe_ckpt.complete_sets(str(save_dir))[0]["num_updates"] == on_disk, what

    # The end state equals the uninterrupted run's, and the save dir holds only complete sets.
    final, reference = (
        moe_ckpt.load_full(str(d / "checkpoint_last.pt")) for d in (save_dir, uninterrupted["save_dir"])
    )
    assert final["moe"]["num_updates"] == LAST_UPDATE
    for key, value in reference["model"].items():
        assert torch.equal(final["model"][key], value), key
    for slot, entry in reference["last_optimizer_state"]["state"].items():
        for name, value in entry.items():
            other = final["last_optimizer_state"]["state"][slot][name]
            assert torch.equal(other, value) if torch.is_tensor(value) else other == value, (slot, name)
    listed = set()
    for manifest_file in save_dir.glob("*.set.json"):
        moe_ckpt.validate_set(str(manifest_file))
        listed |= {e["name"] for e in json.loads(manifest_file.read_text())["files"]}
    leftovers = sorted(p.name for p in save_dir.iterdir() if p.suffix == ".pt" and p.name not in listed)
    assert not leftovers, f"rank files that no complete set lists: {leftovers}"
    assert not list(save_dir.glob("*.prev*")), "the generation protected during a save is removed once it completes"


def test_without_a_launcher_watching_a_dead_worker_makes_the_other_exit_within_seconds(data, tmp_path):
    """As with srun or a hand-written launcher: nobody stops the survivor, the survivor stops itself."""
    port, workers = free_port(), []
    for rank in range(2):
        env = dict(
            fairseq_env(),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONUNBUFFERED="1",
            CRASH_PLAN="1:3:all_to_all:2",
        )
        log = open(tmp_path / f"rank{rank}.log", "w")
        workers.append(
            subprocess.Popen(
                [sys.executable, str(PROBE), *train_args(data, tmp_path / "ck")],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
    try:
        assert workers[1].wait(timeout=300) == -signal.SIGKILL
        died = time.monotonic()
        code = workers[0].wait(timeout=120)
        waited = time.monotonic() - died
    finally:
        for worker in workers:
            worker.kill()
    output = (tmp_path / "rank0.log").read_text()
    assert code != 0 and waited < 60, (code, waited)
    last_error = [line for line in output.splitlines() if "Error: " in line][-1]
    assert "MoECommunicationError: MoE " in last_error and "a peer worker died or stalled" in last_error, last_error
    assert "restart the job with the same command" in last_error


@pytest.mark.parametrize("backend", ["c10d", "legacy_ddp"])
def test_heartbeat_timeout_ends_a_job_whose_worker_stalls_on_either_ddp_backend(data, tmp_path, backend):
    """fairseq's --heartbeat-timeout watchdog guards CPU c10d too (the plugin builds that DDP itself)."""
    args = train_args(data, tmp_path / "ck")
    args[args.index("--ddp-backend") + 1] = backend
    job = Job(tmp_path / "job", [*args, "--heartbeat-timeout", "5", "--no-save"], plan="1:3:stall:300")
    started = time.monotonic()
    code = job.wait(timeout=240)
    took = time.monotonic() - started
    assert code != 0 and took < 120, f"exit {code} after {took:.0f} s"
    assert "not making progress in 5 seconds" in job.output(0), tail(job.output(0), 30)
