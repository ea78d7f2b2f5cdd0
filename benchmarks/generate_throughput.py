#!/usr/bin/env python
"""fairseq-generate sentences per second (beam 5): moe_transformer against a dense transformer with
the same active parameters (see train_wps.py for what that means), in one process and on two
torchrun workers, the MoE model with its experts sharded over them (lock-step decoding).

    python benchmarks/generate_throughput.py            # about 3-4 minutes on 2 CPU cores
    python benchmarks/generate_throughput.py --sentences 800 --repeats 3
    python benchmarks/generate_throughput.py --workers 2 --baseline-user-dir ../other-checkout/fairseq_moe_ext

Both models are trained briefly (fairseq-train, 2 workers, so the MoE checkpoint is a 2-worker set)
on the tests' toy language pair; speed does not depend on how well they translate, and every
hypothesis is forced to --length tokens (--min-len, --max-len-b) so both run the same decoder steps. Throughput
is fairseq-generate's own "Translated N sentences ... in T s" line; for two workers, the sentences
of both over the slower worker's time (all workers wait for the last one in lock-step), and per
process that figure halved.
"""

import argparse
import os
import random
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "recipes"))  # what benchmarks share with tests and recipes

from side_by_side import Loads, run_folder, stamp  # noqa: E402
from toy_pair import source_sentence, translate  # noqa: E402
from train_wps import BIN, USER_DIR, env_for, model_args, preprocess, run, torchrun, training_flags  # noqa: E402

TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \([\d,]+ tokens\) in ([\d.]+)s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--ffn-dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-freq", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--train-updates", type=int, default=30)
    p.add_argument("--sentences", type=int, default=400, help="sentences to translate (default 400)")
    p.add_argument("--batch-size", type=int, default=64, help="fairseq-generate --batch-size (default 64)")
    p.add_argument("--length", type=int, default=12, help="tokens per hypothesis, forced (default 12)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads shared by a run's workers (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="alternate dense/MoE generations this many times")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default 1 2)")
    p.add_argument(
        "--baseline-user-dir",
        help="also generate from the MoE model with the plugin of another checkout "
        "(e.g. ../other-checkout/fairseq_moe_ext), alternating with the others: before/after in one run",
    )
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep", help="keep data and logs in this folder instead of a temporary one")
    return p.parse_args(argv)


def write_corpus(raw: Path, test_lines: int, seed: int = 0) -> Path:
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, lines in (("train", 2000), ("valid", test_lines)):
        sources = [source_sentence(rng) for _ in range(lines)]
        (raw / f"{split}.src").write_text("".join(" ".join(f"s{i}" for i in s) + "\n" for s in sources))
        (raw / f"{split}.tgt").write_text("".join(translate(s) + "\n" for s in sources))
    return raw


def train(args, data, save_dir, moe, work):
    common = [
        *training_flags(args, data, save_dir, args.train_updates),
        *("--no-epoch-checkpoints", "--ddp-backend", "legacy_ddp"),
        *model_args(args, moe),
    ]
    run(torchrun(2, BIN / "fairseq-train", common), env_for(1), args.timeout, work / f"train-{save_dir.name}.log")


def sentences_per_second(args, data, save_dir, workers, log: Path, user_dir=USER_DIR) -> float:
    command = torchrun(
        workers,
        BIN / "fairseq-generate",
        [
            data,
            "--user-dir",
            user_dir,
            "--path",
            save_dir / "checkpoint_last.pt",
            "--cpu",
            "--gen-subset",
            "valid",
            "--beam",
            "5",
            "--batch-size",
            args.batch_size,
            "--num-workers",
            "0",
            # Every hypothesis exactly --length tokens: both models do the same number of decoder steps,
            # whatever each learned in its few updates.
            "--min-len",
            args.length,
            "--max-len-a",
            "0",
            "--max-len-b",
            args.length,
        ],
    )
    output = run(command, env_for(max(1, args.threads // workers)), args.timeout, log)
    found = [(int(n.replace(",", "")), float(t)) for n, t in TRANSLATED.findall(output)]
    if len(found) != workers or sum(n for n, _ in found) != args.sentences:
        sys.exit(
            f"generate_throughput.py: expected {workers} workers translating {args.sentences} sentences, "
            f"found {found} (see {log})"
        )
    return sum(n for n, _ in found) / max(t for _, t in found)


def main(argv=None):
    args = parse_args(argv)
    work = run_folder(args.keep, "generate_throughput_")
    print(f"# fairseq-generate sentences/s (beam 5), {stamp()}, logs in {work}")
    print(
        f"d={args.embed_dim}, {args.layers}+{args.layers} layers, dense FFN H={args.ffn_dim}; MoE every "
        f"{args.moe_freq}-th layer: E={args.experts}, k={args.top_k}, expert hidden {args.ffn_dim // args.top_k}; "
        f"{args.sentences} sentences of {args.length} tokens, --batch-size {args.batch_size}, {args.threads} threads per run"
    )
    data = preprocess(write_corpus(work / "raw", args.sentences), work / "bin", work)
    for moe in (False, True):
        train(args, data, work / ("moe" if moe else "dense"), moe, work)
    results, loads = {}, Loads()
    arms = [("dense", False, USER_DIR), ("moe", True, USER_DIR)]
    arms += [("baseline", True, args.baseline_user_dir)] if args.baseline_user_dir else []
    for rep in range(args.repeats):
        for workers in args.workers:
            for arm, moe, user_dir in arms:  # alternating, so drifts in machine load hit every arm alike
                name = f"{arm}-{workers}w-{rep}"
                with loads.run((workers, arm)):
                    rate = sentences_per_second(
                        args, data, work / ("moe" if moe else "dense"), workers, work / f"{name}.log", user_dir
                    )
                results.setdefault((workers, arm), []).append(rate)
    print(f"\n{'workers':>8}  {'run':<10}{'sent/s':>9}{'/ dense':>9}{'per process':>13}{'load':>12}")
    for workers in args.workers:
        dense = statistics.median(results[(workers, "dense")])
        for arm, _, _ in arms:
            rate, load = statistics.median(results[(workers, arm)]), loads.range((workers, arm))
            print(f"{workers:>8}  {arm:<10}{rate:>9.1f}{rate / dense:>9.3f}{rate / workers:>13.1f}{load:>12}")
    print(
        "2 workers: both split the sentences; the MoE model keeps half of the experts on each worker and "
        "decodes in lock-step (its rounds ride on each stack's first MoE exchange)"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
