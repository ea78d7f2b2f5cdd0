#!/usr/bin/env python
"""``python -m fairseq_moe_ext plan`` against the memory a training step really takes, on the CPU.

For two model sizes (``small``: activations dominate; ``medium``: parameters and Adam state dominate),
one fresh process per size builds fairseq's Trainer from the same arguments plan reads, runs two
training steps (the first builds Adam's state) on the batch plan bounds (sentences of the longest
length, as many as --max-tokens allows, on both sides) and reports how far the steps raised the peak
resident set over the resident set before the model was built. plan's prediction for one worker
(legacy_ddp, W = 1) is printed beside it, and the ratio predicted / measured.

    python benchmarks/plan_memory.py [--sizes small medium] [--threads 1]

The peak RSS also holds what plan does not model (the allocator's slack, fairseq's metrics, the
batch itself, autograd's bookkeeping, the optimizer's temporaries); plan's activation term is a bound
(saved tensors plus twice the largest). Each size is measured twice: with glibc's default allocator,
whose dynamic mmap threshold keeps freed tensors of up to 32 MiB resident, and with the threshold
fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_), which returns every freed tensor to the system.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

# name: (d_model, ffn, layers per side, experts, vocabulary, --max-tokens, sentence length)
SIZES = {
    "small": (128, 512, 2, 4, 8000, 4096, 256),
    "medium": (512, 2048, 2, 8, 4000, 1024, 128),
}


def argv_for(size: str, data: str):
    d, ffn, layers, experts, _, max_tokens, length = SIZES[size]
    # fmt: off
    return [
        data, "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
        "--arch", "moe_transformer", "--share-all-embeddings",
        "--encoder-embed-dim", str(d), "--decoder-embed-dim", str(d),
        "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn),
        "--encoder-layers", str(layers), "--decoder-layers", str(layers),
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
        "--moe-expert-count", str(experts), "--moe-freq", "2",
        "--max-source-positions", str(length), "--max-target-positions", str(length),
        "--max-tokens", str(max_tokens), "--optimizer", "adam", "--lr", "1e-4",
        "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--cpu", "--seed", "1",
    ]
    # fmt: on


def write_dictionaries(data: str, vocabulary: int) -> None:
    for lang in ("src", "tgt"):
        with open(os.path.join(data, f"dict.{lang}.txt"), "w") as f:
            f.writelines(f"w{i} 1\n" for i in range(vocabulary - 4))


def probe(size: str) -> dict:
    """In a fresh process: the growth of the peak resident set over two training steps."""
    import torch
    from fairseq.data import LanguagePairDataset
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    import fairseq_moe_ext
    from fairseq import options, tasks
    from measure import max_rss_bytes

    torch.set_num_threads(int(os.environ.get("PLAN_BENCH_THREADS", "1")))
    _, _, _, _, vocabulary, max_tokens, length = SIZES[size]
    with tempfile.TemporaryDirectory() as data:
        write_dictionaries(data, vocabulary)
        argv = [*argv_for(size, data), "--user-dir", fairseq_moe_ext.PACKAGE_DIR]
        cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
        task = tasks.setup_task(cfg.task)
        g = torch.Generator().manual_seed(0)
        sentences = [torch.randint(4, vocabulary, (length - 1,), generator=g) for _ in range(max_tokens // length)]
        sentences = [torch.cat([s, torch.tensor([task.src_dict.eos()])]) for s in sentences]
        sizes = [len(s) for s in sentences]
        dataset = LanguagePairDataset(sentences, sizes, task.src_dict, sentences, sizes, task.tgt_dict)
        batch = dataset.collater([dataset[i] for i in range(len(sentences))])
        before = current_rss_bytes()
        model = task.build_model(cfg.model)
        trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
        for _ in range(2):
            trainer.train_step([batch])
        peak = max_rss_bytes() - before
    return {"peak": peak, "updates": trainer.get_num_updates(), "tokens": int(batch["ntokens"])}


def current_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def predicted(size: str) -> dict:
    from fairseq_moe_ext.training import memory_plan as mp
    from fairseq_moe_ext.training.activation_bound import activation_bytes
    from fairseq_moe_ext.training.plan_cli import model_shapes, optimizer_of, worker_bytes
    from fairseq_moe_ext.training.plan_model import build_on_meta

    vocabulary = SIZES[size][4]
    cfg, _, model = build_on_meta(argv_for(size, "data-bin"), vocabulary)
    shapes = model_shapes(model)
    precision = mp.precision_of(lambda name: getattr(cfg.common, name, False))
    optimizer, options = optimizer_of(cfg)
    layout = mp.Layout(1, 1, backend="legacy_ddp")
    held = worker_bytes(shapes, layout, precision, optimizer, options)
    states = held["shared"].total + held["expert"].total + held["buffers"]
    activations = activation_bytes(cfg, model, shapes, precision)(layout)
    return {"states": states, "activations": activations, "total": states + activations}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--probe", choices=list(SIZES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe)))
        return
    import logging
    import warnings

    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    from measure import machine_summary

    print(machine_summary("cpu"))
    print(
        "measured: peak RSS growth over two training steps, with glibc's default allocator (its mmap threshold "
        "grows to 32 MiB, so freed tensors below it stay resident) and with MALLOC_MMAP_THRESHOLD_=131072 "
        "(every tensor above 128 KiB mapped and returned when freed: closer to the live bytes)"
    )
    print(
        f"{'size':<8}{'params+grads+adam':>19}{'activ. bound':>14}{'predicted':>11}"
        f"{'default':>10}{'pred/meas':>11}{'fixed':>10}{'pred/meas':>11}"
    )
    for size in args.sizes:
        want = predicted(size)
        got = {}
        for name, extra in (("default", {}), ("fixed", {"MALLOC_MMAP_THRESHOLD_": "131072"})):
            env = dict(os.environ, PLAN_BENCH_THREADS=str(args.threads), **extra)
            done = subprocess.run(
                [sys.executable, __file__, "--probe", size], capture_output=True, text=True, env=env, timeout=900
            )
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
                last = (done.stderr.strip().splitlines() or [""])[-1]
                raise SystemExit(f"{size}: the probe failed (exit {done.returncode}): {last}")
            got[name] = json.loads(lines[-1])
        mib = lambda n: f"{n / 2**20:.0f} MiB"
        ratio = lambda name: f"{want['total'] / got[name]['peak']:>10.2f}x"
        print(
            f"{size:<8}{mib(want['states']):>19}{mib(want['activations']):>14}{mib(want['total']):>11}"
            f"{mib(got['default']['peak']):>10}{ratio('default')}{mib(got['fixed']['peak']):>10}{ratio('fixed')}"
            f"   ({got['fixed']['tokens']} target tokens, {got['fixed']['updates']} updates)"
        )


if __name__ == "__main__":
    main()
