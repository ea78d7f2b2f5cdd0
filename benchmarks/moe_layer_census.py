"""Section (0) of moe_layer.py: the layer's census, collectives and host syncs of one layer call by mode, on 2 gloo
worker processes on the CPU (what the counts are does not depend on the device: the GPU one-shot records them on
CUDA, benchmarks/device/oneshot_census.py). The harness is recipes/layer_census.py, which the census test
(tests/core/test_collective_census.py) runs on threads."""

import os
import sys
from socket import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from layer_census import census_of_modes, census_table, timed_call, timed_lines  # noqa: E402

WORKERS = 2


def _worker(rank, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    try:
        results[rank] = census_of_modes(dist.group.WORLD, rank), timed_call(dist.group.WORLD, rank)
    finally:
        dist.destroy_process_group()


def census_section(report) -> None:
    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, results), nprocs=WORKERS, join=True)
        by_rank = [results[rank][0] for rank in range(WORKERS)]
        timed = results[0][1]
    print(f"\n## Census: collectives and host syncs of one layer call, per worker ({WORKERS} gloo workers, CPU)")
    print(census_table(by_rank[0]))
    if census_table(by_rank[0]) != census_table(by_rank[1]):
        print(f"worker 1 counts otherwise:\n{census_table(by_rank[1])}")
    print(
        "\nTime in each collective of one training call on worker 0 (d 512, H 1024, E 8, k 2, 2048 tokens per worker):"
    )
    print(timed_lines(timed))
    report["census"] = [{mode: vars(c) for mode, c in counts.items()} for counts in by_rank]
    report["collective_seconds"] = timed
