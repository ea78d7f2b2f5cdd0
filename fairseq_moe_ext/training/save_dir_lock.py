"""One training job per save dir: a lock file naming the job that writes there.

Two jobs saving into one directory overwrite each other's rank files and manifests, and the next
resume then reports "damaged" sets although nothing failed but the setup. fairseq-train takes the
lock (rank 0 for a multi-worker job) before it reads or writes any checkpoint, and drops it at exit.

A lock is stale, and taken over with a warning, when its holder is on this host and no longer
alive (a job killed with SIGKILL, or torchrun's SIGTERM, never runs its exit handlers), when the
pid is alive but the process started after the lock was written (a recycled pid: containers
restart their processes under the same small pids), or when the holder is this very job restarted
(the same ``SLURM_JOB_ID``, or an explicit torchrun ``--rdzv-id``: a preempted and requeued job may
come back on another node). Any other lock held on another host is never broken automatically:
that host's pids cannot be checked from here, and a lock's age tells a long run from a dead one no
better; the message names the holder and says to delete the file once that job is known to be
gone. Nothing here imports fairseq.
"""

import datetime
import json
import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

from ..common.refusal import MoERefusal

logger = logging.getLogger(__name__)

LOCK_NAME = "fairseq-moe-ext.lock"


class SaveDirLockedError(MoERefusal, RuntimeError):
    """Another live job writes the save dir; the message is one line naming it and the fix."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str  # UTC, ISO 8601
    job: str  # the launcher's job id (torchrun, SLURM) or a random one

    def describe(self) -> str:
        return f"job {self.job} (pid {self.pid} on {self.host}, started {self.started})"


def launcher_job_id() -> Optional[str]:
    """The job id a launcher gave this job, kept across restarts of the job; torchrun's default
    rendezvous id "none" names no job."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return os.environ.get("SLURM_JOB_ID") or (run_id if run_id and run_id != "none" else None)


def this_job() -> Holder:
    job = launcher_job_id() or uuid.uuid4().hex[:12]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Holder(socket.gethostname(), os.getpid(), started, job)


def lock_path(save_dir: str) -> str:
    return os.path.join(save_dir, LOCK_NAME)


def acquire(save_dir: str, me: Optional[Holder] = None) -> Holder:
    """Take the save dir's lock for ``me`` (default: this process) and return who holds it now."""
    me = me or this_job()
    path = lock_path(save_dir)
    for _ in range(3):  # a stale lock taken over by a third job in between: look again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_holder(path)
            if holder is not None and holder.host == me.host and holder.pid == me.pid:
                return holder  # this process took it already (fairseq-train's main run twice in one process)
            stale = None if holder is None else why_stale(holder, me)
            if stale is not None:
                logger.warning(f"taking over the lock {path} of {holder.describe()}: {stale}")
                _remove_if_held_by(path, holder)
                continue
            raise SaveDirLockedError(_refusal(path, holder, me))
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(me), f)
            f.flush()
            os.fsync(f.fileno())
        return me
    raise SaveDirLockedError(_refusal(path, read_holder(path), me))


def release(save_dir: str, me: Holder) -> None:
    """Drop the lock if ``me`` still holds it (never another job's)."""
    _remove_if_held_by(lock_path(save_dir), me)


def read_holder(path: str) -> Optional[Holder]:
    """The lock's holder, or None if the file is gone, empty or not a lock this plugin wrote."""
    try:
        with open(path) as f:
            fields = json.load(f)
        return Holder(str(fields["host"]), int(fields["pid"]), str(fields["started"]), str(fields["job"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def why_stale(holder: Holder, me: Holder) -> Optional[str]:
    """Why ``holder``'s lock no longer protects a running job, or None if it may."""
    if (
        holder.job == me.job
        and holder.job == launcher_job_id()
        and (holder.host != me.host or not pid_alive(holder.pid))
    ):
        return f"it is this job ({holder.job}), restarted"
    if holder.host != me.host:
        return None
    if not pid_alive(holder.pid):
        return "it is no longer running"
    if process_started_after(holder.pid, holder.started):
        return f"pid {holder.pid} now belongs to a process started after the lock was written (a recycled pid)"
    return None


def process_started_after(pid: int, moment: str) -> bool:
    """Whether process ``pid`` started more than a second after ``moment`` (ISO 8601); False where
    that cannot be told (no /proc, unreadable fields)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after "pid (comm)"
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
        return started > datetime.datetime.fromisoformat(moment).timestamp() + 1.0
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, under another user
    return True


def _remove_if_held_by(path: str, holder: Holder) -> None:
    if read_holder(path) == holder:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _refusal(path: str, holder: Optional[Holder], me: Holder) -> str:
    if holder is None:
        who = "a job this plugin cannot identify (the lock file is empty or unreadable)"
    elif holder.host == me.host:
        who = f"{holder.describe()}, which is still running"
    else:
        who = f"{holder.describe()}, on another host"
    return (
        f"--save-dir {os.path.dirname(path) or '.'} is locked by {who}: two jobs saving into one directory "
        f"overwrite each other's checkpoints; give this run another --save-dir, or, if that job is gone, "
        f"delete {path}"
    )
