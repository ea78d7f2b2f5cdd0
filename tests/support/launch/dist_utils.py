"""Run a function on W real gloo workers (CPU processes) and collect what each returns.

The workers are forks of a multiprocessing forkserver that has imported torch, fairseq and the package once
(``spawn`` paid those imports, about 2.5 s of CPU, in every worker); each takes the test's environment as it
is when the workers start, as a spawned worker would.
"""

import atexit
import multiprocessing.forkserver
import os
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Rendezvous ports come from below Linux's ephemeral range (32768-60999), so that no outgoing
# connection (gloo's own, pip's, another test's) can take one between our check and torchrun's
# bind, and above fairseq's own pick (random 10000-20000 when no port is given). Each pytest-xdist
# worker draws from its own slice (PYTEST_XDIST_WORKER=gwN), stepping through it from a start
# drawn from the process id (so concurrent suites on one machine rarely meet), and skips a port
# that something holds. A port is never handed out twice by one process.
PORT_RANGE = (20000, 32768)
SLICES = 8  # xdist workers up to 8 get disjoint slices; more share them, still checked by bind
_next_port = {}


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (PORT_RANGE[1] - PORT_RANGE[0]) // SLICES
    low = PORT_RANGE[0] + (index % SLICES) * width
    offset = _next_port.setdefault(low, os.getpid() * 7919 % width)
    for step in range(width):
        port = low + (offset + step) % width
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _next_port[low] = (offset + step + 1) % width
        return port
    raise RuntimeError(f"no free port in {low}..{low + width - 1}")


PRELOAD = ["torch", "torch.distributed", "fairseq", "fairseq_moe_ext"]
_context = None


def worker_context():
    """The forkserver context, its server importing ``PRELOAD`` when it starts (on first use)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        # Stopped and waited for at exit, so that its workers' CPU time counts in tests/run.sh's figure.
        atexit.register(multiprocessing.forkserver._forkserver._stop)
    return _context


def _become(environ):
    """What a spawned worker inherits, in a fork of the server: the test's environment now, one thread."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)


def _worker(rank, world_size, port, fn, args, out_dir, environ):
    _become(environ)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on_workers(fn, world_size, *args):
    """``fn(rank, world_size, *args)`` in each worker; returns the list of results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        worker_context()
        worker_args = (world_size, free_port(), fn, args, out_dir, dict(os.environ))
        mp.start_processes(_worker, args=worker_args, nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]


def _recording_worker(rank, world_size, port, fn, args, out_dir, timeout_s, environ):
    _become(environ)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **timeout)
    try:
        result = {"returned": fn(rank, world_size, *args)}
    except Exception as error:  # the outcome under test: recorded, not raised
        result = {"error": type(error).__name__, "message": str(error), "at": time.monotonic()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # no process-group teardown: its peers may be gone


def run_workers_through_faults(fn, world_size, *args, deadline=120.0, timeout_s=None):
    """Like ``run_on_workers``, but a worker that dies does not stop the others (as under a
    launcher that does not watch its workers); ``timeout_s``: the default process group's timeout
    (torch's 30 minutes if None). Returns, by rank, ``{"returned": value}``,
    ``{"error": type name, "message": str, "at": time.monotonic()}``, or ``None`` for a worker
    that left no result (killed) or was still running at the deadline (then killed)."""
    context = worker_context()
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        workers = [
            context.Process(
                target=_recording_worker, args=(rank, world_size, port, fn, args, out_dir, timeout_s, dict(os.environ))
            )
            for rank in range(world_size)
        ]
        for worker in workers:
            worker.start()
        stop = time.monotonic() + deadline
        for worker in workers:
            worker.join(max(0.0, stop - time.monotonic()))
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            results.append(torch.load(path) if os.path.exists(path) else None)
        return results
