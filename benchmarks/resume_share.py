#!/usr/bin/env python
"""What one worker reads to resume from a checkpoint set, before and after "resume reads only a
worker's share", measured side by side on one W-file set.

    python benchmarks/resume_share.py                  # W=4, ~50 MB per rank file
    python benchmarks/resume_share.py --world-size 8 --mb-per-file 20

before: every worker validates the set (sha256 of every file, in resolve), then load_set validates
        it again and loads every file, merges, and slices its share (the code before this change,
        still what the checkpoint tool's merge does).
after:  rank 0 validates once (every file hashed); each worker then loads file 0 and the files
        holding its experts (checkpoint/share.py).
Bytes are this process's read() bytes from /proc/self/io (torch.load's C++ reader included); the
files are in the page cache after the first pass, so times compare work, not disk speed.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fairseq_moe_ext import checkpoint as moe_ckpt  # noqa: E402
from fairseq_moe_ext.checkpoint.share import load_share  # noqa: E402

EXPERT_KEY = "decoder.layers.1.fc1.experts.batched_fc1_w"


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def write_set(directory: str, world: int, mb_per_file: float) -> str:
    experts = 2 * world
    rows = max(1, int(mb_per_file * 2**20 / (experts / world) / 2 / 4 / 256))  # weights + exp_avg, fp32, width 256
    model = {EXPERT_KEY: torch.randn(experts, rows, 256), "decoder.embed_tokens.weight": torch.randn(1000, 256)}
    names = ["decoder.embed_tokens.weight", EXPERT_KEY]
    state = {
        "model": model,
        "optimizer_history": [{"num_updates": 10}],
        "last_optimizer_state": {
            "state": {0: {"exp_avg": torch.zeros(1000, 256)}, 1: {"exp_avg": torch.randn(experts, rows, 256)}},
            "param_groups": [{"params": [0, 1]}],
        },
        "extra_state": {"epoch": 1},
        "moe": moe_ckpt.moe_metadata(names, [EXPERT_KEY], 1, 0, 10, experts_per_worker=experts),
    }
    return moe_ckpt.save_set(state, os.path.join(directory, "checkpoint_last"), world)


def before(manifest: str, rank: int, world: int):
    moe_ckpt.validate_set(manifest)  # resolve, on every worker
    return moe_ckpt.shard_state(moe_ckpt.load_set(manifest), rank, world)


def after(manifest: str, rank: int, world: int):
    if rank == 0:
        moe_ckpt.validate_set(manifest)  # resolve, on rank 0 only
    return load_share(manifest, rank, world, lambda path: moe_ckpt.safe_load(path, verified=True))


def measure(fn, manifest, rank, world):
    start_bytes, start = bytes_read(), time.perf_counter()
    state = fn(manifest, rank, world)
    return time.perf_counter() - start, bytes_read() - start_bytes, state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mb-per-file", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not os.path.exists("/proc/self/io"):
        print("needs Linux's /proc/self/io to count bytes read", file=sys.stderr)
        return 2
    world = args.world_size
    with tempfile.TemporaryDirectory() as directory:
        manifest = write_set(directory, world, args.mb_per_file)
        set_bytes = sum(f["bytes"] for f in moe_ckpt.read_manifest(manifest)["files"])
        print(f"set: {world} rank files, {set_bytes / 2**20:.1f} MiB in all")
        print(
            f"{'rank':>4} {'before MiB':>11} {'after MiB':>10} {'bytes ratio':>11} {'before s':>9} {'after s':>8} "
            f"{'time ratio':>10}"
        )
        for rank in range(world):
            runs = {"before": [], "after": []}
            for _ in range(args.repeats):  # interleaved, medians: the machine is noisy
                for name, fn in (("before", before), ("after", after)):
                    runs[name].append(measure(fn, manifest, rank, world))
            old, new = (sorted(runs[n], key=lambda r: r[0])[len(runs[n]) // 2] for n in ("before", "after"))
            for key in old[2]["model"]:
                assert torch.equal(old[2]["model"][key], new[2]["model"][key]), key  # the same share either way
            print(
                f"{rank:>4} {old[1] / 2**20:>11.1f} {new[1] / 2**20:>10.1f} {new[1] / old[1]:>11.2f} "
                f"{old[0]:>9.3f} {new[0]:>8.3f} {new[0] / old[0]:>10.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
