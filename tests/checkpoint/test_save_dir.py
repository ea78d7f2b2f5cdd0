"""fairseq-train's claim on --save-dir: one job per directory (a lock file with stale-lock
detection), and one directory for every worker of a multi-worker job.

In-process checks of the lock and of the shared-directory probe; tests/cli/test_multiworker_cli.py and
tests/cli/test_bad_input.py run the same through fairseq-train.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from fairseq_moe_ext.training import save_dir_lock, shared_save_dir
from fairseq_moe_ext.training.save_dir_lock import Holder, SaveDirLockedError


def a_dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


A_WHILE_AGO = "2026-01-01T00:00:00+00:00"  # before any process of this machine started


def job(pid, host=None, name="j1", started=None):
    """A lock holder; ``started`` defaults to now, as a lock written by a running job would say."""
    return Holder(host or save_dir_lock.this_job().host, pid, started or save_dir_lock.this_job().started, name)


def write_lock(directory, holder):
    (directory / save_dir_lock.LOCK_NAME).write_text(json.dumps(dataclasses.asdict(holder)))


def test_the_lock_names_host_pid_start_time_and_job_and_is_released_by_its_holder_only(tmp_path):
    me = save_dir_lock.acquire(str(tmp_path))
    fields = json.loads((tmp_path / save_dir_lock.LOCK_NAME).read_text())
    assert fields == dataclasses.asdict(me) and fields["pid"] == os.getpid()
    assert set(fields) == {"host", "pid", "started", "job"}
    save_dir_lock.release(str(tmp_path), dataclasses.replace(me, job="someone else"))
    assert (tmp_path / save_dir_lock.LOCK_NAME).exists()
    save_dir_lock.release(str(tmp_path), me)
    assert not list(tmp_path.iterdir())


def test_taking_the_lock_again_in_the_process_that_holds_it_succeeds(tmp_path):
    first = save_dir_lock.acquire(str(tmp_path))
    assert save_dir_lock.acquire(str(tmp_path)) == first


@pytest.mark.parametrize(
    "holder, says",
    [
        (lambda: job(os.getppid()), "which is still running"),
        (lambda: job(a_dead_pid(), host="another-host.example"), "on another host"),
        (lambda: None, "a job this plugin cannot identify"),
    ],
    ids=["live-pid-on-this-host", "another-host", "unreadable-lock"],
)
def test_a_lock_held_by_a_live_job_or_on_another_host_refuses_a_second_writer_in_one_line(tmp_path, holder, says):
    held = holder()
    if held is None:
        (tmp_path / save_dir_lock.LOCK_NAME).write_text("")  # a writer stopped between create and write
    else:
        write_lock(tmp_path, held)
    before = (tmp_path / save_dir_lock.LOCK_NAME).read_bytes()
    with pytest.raises(SaveDirLockedError) as refused:
        save_dir_lock.acquire(str(tmp_path))
    message = str(refused.value)
    assert message.startswith(f"--save-dir {tmp_path} is locked by ") and says in message
    if held is not None:
        assert f"job j1 (pid {held.pid} on {held.host}" in message
    assert message.endswith(
        f"give this run another --save-dir, or, if that job is gone, delete {tmp_path / save_dir_lock.LOCK_NAME}"
    )
    assert "\n" not in message
    assert (tmp_path / save_dir_lock.LOCK_NAME).read_bytes() == before


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog):
    stale = job(a_dead_pid())
    write_lock(tmp_path, stale)
    me = save_dir_lock.acquire(str(tmp_path))
    assert me.pid == os.getpid()
    assert save_dir_lock.read_holder(str(tmp_path / save_dir_lock.LOCK_NAME)) == me
    assert f"taking over the lock {tmp_path / save_dir_lock.LOCK_NAME} of job j1 (pid {stale.pid}" in caplog.text


@pytest.fixture
def one_worker_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_save_dir_probe_passes_and_leaves_nothing_where_every_worker_sees_it(tmp_path, one_worker_group):
    save_dir = tmp_path / "ck"
    save_dir.mkdir()
    shared_save_dir.check_save_dir_shared(str(save_dir), rank=0)
    assert not list(save_dir.iterdir())


def test_a_worker_that_does_not_see_the_save_dir_stops_the_job_with_one_line_naming_it(
    tmp_path, monkeypatch, one_worker_group
):
    save_dir = tmp_path / "ck"
    save_dir.mkdir()
    monkeypatch.setattr(shared_save_dir, "read_token", lambda path: None)  # a node-local directory
    with pytest.raises(shared_save_dir.SaveDirNotSharedError) as refused:
        shared_save_dir.check_save_dir_shared(str(save_dir), rank=0)
    message = str(refused.value)
    assert message.startswith(f"worker(s) 0 of 1 do not see the file worker 0 wrote into --save-dir {save_dir}")
    assert "a multi-worker save dir must be on a filesystem all workers share" in message
    assert "\n" not in message
    assert not list(save_dir.iterdir())


def test_a_lock_whose_pid_was_reused_by_a_later_process_is_taken_over(tmp_path, caplog):
    # Containers restart their processes under the same small pids: a live pid proves nothing when
    # that process is younger than the lock.
    write_lock(tmp_path, job(os.getppid(), started=A_WHILE_AGO))
    me = save_dir_lock.acquire(str(tmp_path))
    assert save_dir_lock.read_holder(str(tmp_path / save_dir_lock.LOCK_NAME)) == me
    assert "a recycled pid" in caplog.text


@pytest.mark.parametrize("variable, value", [("SLURM_JOB_ID", "4242"), ("TORCHELASTIC_RUN_ID", "run-7")])
def test_a_lock_of_this_very_job_restarted_on_another_node_is_taken_over(
    tmp_path, monkeypatch, caplog, variable, value
):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv(variable, value)
    write_lock(tmp_path, job(12345, host="node-before-requeue.example", name=value))
    me = save_dir_lock.acquire(str(tmp_path))
    assert me.job == value and save_dir_lock.read_holder(str(tmp_path / save_dir_lock.LOCK_NAME)) == me
    assert f"it is this job ({value}), restarted" in caplog.text


def test_torchruns_default_rendezvous_id_does_not_make_two_jobs_on_two_hosts_one_job(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    write_lock(tmp_path, job(12345, host="another-host.example", name="none"))
    with pytest.raises(SaveDirLockedError, match="on another host"):
        save_dir_lock.acquire(str(tmp_path))
