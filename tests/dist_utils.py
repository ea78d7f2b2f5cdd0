"""Run a function on W real gloo workers (CPU processes) and collect what each returns."""

import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on_workers(fn, world_size, *args):
    """``fn(rank, world_size, *args)`` in each worker; returns the list of results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]


def _recording_worker(rank, world_size, port, fn, args, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = {"returned": fn(rank, world_size, *args)}
    except Exception as error:  # the outcome under test: recorded, not raised
        result = {"error": type(error).__name__, "message": str(error), "at": time.monotonic()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # no process-group teardown: its peers may be gone


def run_workers_through_faults(fn, world_size, *args, deadline=120.0):
    """Like ``run_on_workers``, but a worker that dies does not stop the others (as under a
    launcher that does not watch its workers). Returns, by rank, ``{"returned": value}``,
    ``{"error": type name, "message": str, "at": time.monotonic()}``, or ``None`` for a worker
    that left no result (killed) or was still running at the deadline (then killed)."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        workers = [
            context.Process(target=_recording_worker, args=(rank, world_size, port, fn, args, out_dir))
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
