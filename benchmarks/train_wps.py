#!/usr/bin/env python
"""fairseq-train words per second: moe_transformer against a dense transformer with the same
active parameters, on the same generated data with the same settings, in one process and with two
workers (torchrun, gloo, legacy_ddp; ``--backends legacy_ddp fully_sharded`` adds the MoE model
under fully_sharded, torch FSDP2), with each run's peak resident memory per worker.

    python benchmarks/train_wps.py            # about 3-4 minutes on 2 CPU cores
    python benchmarks/train_wps.py --repeats 3 --max-update 80

Same active parameters: every MoE layer has E experts of hidden H/k and routes each token to k of
them, so a token meets k*(H/k) = H hidden units, exactly as in the dense model's FFN of hidden H;
attention, embeddings and the dense layers are identical. The difference in speed is the cost of
routing, dispatch and combine (and, with two workers, of the all-to-all exchange).

wps is fairseq's own figure from ``--log-format json`` train_inner records (target tokens per
second over all workers); the first record of each run is dropped as warm-up and the median of the
rest is reported. Peak memory is the largest resident set of any process of the run (a worker:
torchrun itself stays small), from getrusage of a wrapper that runs only that command.
"""

import argparse
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "recipes"))  # what benchmarks share with tests and recipes
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from fairseq_logs import json_records  # noqa: E402
from fairseq_moe_ext import PACKAGE_DIR as USER_DIR  # noqa: E402
from side_by_side import Loads, run_folder, stamp  # noqa: E402
from toy_pair import source_sentence, translate  # noqa: E402

BIN = Path(sys.executable).parent


def tail(output: str, lines: int = 40) -> str:
    return "\n".join(output.splitlines()[-lines:])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--ffn-dim", type=int, default=1024, help="dense FFN hidden size H (default 1024)")
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers each (default 2)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-freq", type=int, default=2, help="every n-th layer is MoE (default 2)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--max-update", type=int, default=40)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--sentences", type=int, default=4000, help="training sentence pairs to generate")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default 1 2)")
    p.add_argument(
        "--backends",
        nargs="+",
        default=["legacy_ddp"],
        choices=["legacy_ddp", "fully_sharded"],
        help="--ddp-backend of the multi-worker MoE runs (default legacy_ddp); the dense runs use legacy_ddp",
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads shared by a run's workers (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="alternate dense/MoE runs this many times")
    p.add_argument(
        "--baseline-user-dir",
        help="also time the MoE model with the plugin of another checkout "
        "(e.g. ../other-checkout/fairseq_moe_ext), alternating with the others: before/after in one run",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds per fairseq-train run")
    p.add_argument("--keep", help="keep data and logs in this folder instead of a temporary one")
    return p.parse_args(argv)


def write_corpus(raw: Path, train_lines: int, seed: int = 0) -> Path:
    """The tests' toy language pair (reverse and map every token), at a size worth timing."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, lines in (("train", train_lines), ("valid", 40)):
        sources = [source_sentence(rng) for _ in range(lines)]
        (raw / f"{split}.src").write_text("".join(" ".join(f"s{i}" for i in s) + "\n" for s in sources))
        (raw / f"{split}.tgt").write_text("".join(translate(s) + "\n" for s in sources))
    return raw


# Runs the command and prints the largest resident set (KiB) of it or any descendant it waited for.
PEAK_RSS = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
    "print(f'peak rss kib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}'); sys.exit(code)"
)


def run(command, env, timeout, log: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *[str(c) for c in command]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        timeout=timeout,
    )
    log.write_text(done.stdout)
    if done.returncode != 0:
        sys.exit(f"train_wps.py: exit {done.returncode}: {' '.join(map(str, command))}\n{tail(done.stdout)}")
    return done.stdout


def peak_rss_mib(output: str) -> float:
    return int(output.rsplit("peak rss kib ", 1)[1].split()[0]) / 1024


def env_for(threads_per_worker: int):
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads_per_worker), MKL_NUM_THREADS=str(threads_per_worker), PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def preprocess(raw: Path, dest: Path, work: Path):
    run(
        [
            sys.executable,
            "-m",
            "fairseq_cli.preprocess",
            "--source-lang",
            "src",
            "--target-lang",
            "tgt",
            f"--trainpref={raw / 'train'}",
            f"--validpref={raw / 'valid'}",
            f"--destdir={dest}",
            "--workers=1",
        ],
        env_for(1),
        300,
        work / "preprocess.log",
    )
    return dest


def model_args(args, moe: bool):
    dims = []
    for side in ("encoder", "decoder"):
        dims += [
            f"--{side}-embed-dim",
            args.embed_dim,
            f"--{side}-ffn-embed-dim",
            args.ffn_dim,
            f"--{side}-layers",
            args.layers,
            f"--{side}-attention-heads",
            4,
        ]
    if not moe:
        return ["--arch", "transformer", *dims, "--criterion", "label_smoothed_cross_entropy"]
    return [
        "--arch",
        "moe_transformer",
        *dims,
        "--criterion",
        "moe_label_smoothed_cross_entropy",
        "--moe-expert-count",
        args.experts,
        "--moe-top-k",
        args.top_k,
        "--moe-freq",
        args.moe_freq,
        "--moe-expert-ffn-dim",
        args.ffn_dim // args.top_k,
    ]


def training_flags(args, data: Path, save_dir: Path, max_update, user_dir=USER_DIR):
    """The fairseq-train flags both benchmarks train with (generate_throughput.py trains the models it times)."""
    # fmt: off
    return [data, "--user-dir", user_dir, "--cpu", "--seed", "1", "--num-workers", "0", "--label-smoothing", "0.1",
            "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", args.max_tokens, "--max-update", max_update,
            "--disable-validation", "--save-dir", save_dir]
    # fmt: on


def torchrun(workers, program, args):
    """``program args`` in this process for one worker, or under torchrun for several."""
    if workers == 1:
        return [program, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        workers,
        "--master_port",
        free_port(),
        program,
        *args,
        "--distributed-world-size",
        workers,
    ]


def train_command(args, data: Path, save_dir: Path, moe: bool, workers: int, user_dir=USER_DIR, backend="legacy_ddp"):
    common = [
        *training_flags(args, data, save_dir, args.max_update, user_dir),
        *("--dropout", "0.1", "--no-save", "--log-format", "json", "--log-interval", args.log_interval),
        *model_args(args, moe),
    ]
    command = torchrun(workers, BIN / "fairseq-train", common)
    return command if workers == 1 else [*command, "--ddp-backend", backend]


def free_port() -> int:
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured_wps(output: str) -> float:
    records = json_records(output, "train_inner")
    if len(records) < 2:
        sys.exit(f"train_wps.py: fewer than 2 train_inner records; raise --max-update\n{tail(output)}")
    return statistics.median(float(r["wps"]) for r in records[1:])


def main(argv=None):
    args = parse_args(argv)
    if args.ffn_dim % args.top_k:
        sys.exit(f"train_wps.py: --ffn-dim {args.ffn_dim} must be divisible by --top-k {args.top_k}")
    work = run_folder(args.keep, "train_wps_")
    print(
        f"# fairseq-train wps, {stamp()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, logs in {work}"
    )
    print(
        f"d={args.embed_dim}, {args.layers}+{args.layers} layers, dense FFN H={args.ffn_dim}; MoE in every "
        f"{args.moe_freq}-th layer: E={args.experts}, k={args.top_k}, expert hidden {args.ffn_dim // args.top_k}; "
        f"--max-tokens {args.max_tokens}, {args.max_update} updates, {args.threads} threads per run"
    )
    data = preprocess(write_corpus(work / "raw", args.sentences), work / "bin", work)
    results, memory, loads = {}, {}, Loads()
    for workers in args.workers:
        env = env_for(max(1, args.threads // workers))
        for rep in range(args.repeats):
            arms = [("dense", False, USER_DIR, "legacy_ddp")]
            arms += [
                ("moe" if b == "legacy_ddp" else f"moe {b}", True, USER_DIR, b)
                for b in (args.backends if workers > 1 else ["legacy_ddp"])
            ]
            if args.baseline_user_dir:
                arms.append(("baseline", True, args.baseline_user_dir, "legacy_ddp"))
            for arm, moe, user_dir, backend in arms:  # alternating, so drifts in machine load hit all alike
                name = f"{arm.replace(' ', '-')}-{workers}w-{rep}"
                with loads.run((workers, arm)):
                    output = run(
                        train_command(args, data, work / name, moe, workers, user_dir, backend),
                        env,
                        args.timeout,
                        work / f"{name}.log",
                    )
                results.setdefault((workers, arm), []).append(measured_wps(output))
                memory.setdefault((workers, arm), []).append(peak_rss_mib(output))
    print(f"\n{'workers':>8}  {'run':<18}{'wps':>8}{'/ dense':>9}{'peak MiB per worker':>21}{'load':>12}")
    for workers in args.workers:
        dense = statistics.median(results[(workers, "dense")])
        for (w, arm), wps in results.items():
            if w == workers:
                wps, load = statistics.median(wps), loads.range((w, arm))
                print(f"{workers:>8}  {arm:<18}{wps:>8.0f}{wps / dense:>9.3f}{max(memory[(w, arm)]):>21.0f}{load:>12}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
