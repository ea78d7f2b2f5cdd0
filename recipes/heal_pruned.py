"""Healing pruned sets: each dialect's set pruned by recipes/prune_by_dialect.py trained on that dialect's own
sentences for ``--updates`` updates with ``--criterion moe_distillation`` from the full set (the teacher, its
experts spread over the training workers when its set was saved by as many), and, to tell the teacher's part
from the training's, the same updates with the labels alone (``--criterion moe_label_smoothed_cross_entropy``);
then each generates its dialect's test sentences. Reads a finished pruning run (its sets, results.json) and the
main job's flags (WORK/common_args.txt, written by recipes/main.sh); writes OUT/healed.json and OUT/healed.md.

  python recipes/heal_pruned.py --work work-dirs/main --pruning work-dirs/main/pruning [--fractions 0.5 0.25] \
      [--updates 200] [--lr 1e-3] [--warmup 20] [--weight 0.5] [--temperature 1] [--workers 2] [--beam 5] [--no-plain]
      [--dialects D ...]
"""

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from checkpoint_flags import model_flags
from prune_by_dialect import BIN, bleu, generate, run

RESETS = ["--reset-optimizer", "--reset-dataloader", "--reset-meters", "--reset-lr-scheduler"]


def dialect_data(work: Path, out: Path, dialect: str) -> Path:
    """The dialect's own train, valid and test pairs, binarised with the main job's dictionaries."""
    data = out / "data" / dialect / "bin"
    if (data / ".done").exists():
        return data
    prefixes = {}
    for split in ("train", "valid", "test"):
        labels = (work / f"data/raw/{split}.domain").read_text().splitlines()
        prefix = out / "data" / dialect / "tok" / split
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for side in ("src", "tgt"):
            lines = (work / f"data/tok/{split}.{side}").read_text().splitlines()
            Path(f"{prefix}.{side}").write_text("".join(x + "\n" for x, lab in zip(lines, labels) if lab == dialect))
        prefixes[split] = prefix
    dicts = work / "data/bin"
    run([BIN / "fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", prefixes["train"],
         "--validpref", prefixes["valid"], "--testpref", prefixes["test"], "--srcdict", dicts / "dict.src.txt",
         "--tgtdict", dicts / "dict.tgt.txt", "--destdir", data, "--workers", 1],
        out / "data" / dialect / "preprocess.log")  # fmt: skip
    (data / ".done").write_text("")
    return data


def train(workers: int, args, log: Path) -> None:
    """fairseq-train on ``workers`` CPU workers (torchrun + gloo), as the README documents."""
    command = [BIN / "fairseq-train", *args]
    if workers > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", workers,
                   *command, "--distributed-world-size", workers]  # fmt: skip
    run(command, log)


def tune(args, common, pruned: Path, data: Path, save: Path, teacher) -> Path:
    """``pruned`` trained on ``data`` for --updates updates, with the full set as its teacher or (None) the labels
    alone; its checkpoint_last (trained once: a run finished with these flags is kept, one of other flags redone)."""
    criterion = ["--criterion", "moe_label_smoothed_cross_entropy"]
    if teacher is not None:
        criterion = ["--criterion", "moe_distillation", "--distill-teacher", teacher, "--distill-weight",
                     args.weight, "--distill-temperature", args.temperature]  # fmt: skip
    flags = [data, *common[1:], "--arch", "moe_transformer", *model_flags(str(pruned)), *criterion]
    flags += ["--restore-file", pruned, *RESETS, "--max-update", args.updates, "--lr", args.lr]
    flags += ["--warmup-updates", args.warmup, "--save-dir", save, "--no-epoch-checkpoints"]
    flags += ["--required-batch-size-multiple", 1]  # a dialect's few valid sentences still make a batch
    signature = " ".join(map(str, [args.workers, *flags]))
    done = (save / ".done").exists()
    if done and not (save / ".flags").exists():  # finished before runs kept their flags: taken as made with these
        (save / ".flags").write_text(signature)
    if not (done and (save / ".flags").read_text() == signature):
        shutil.rmtree(save, ignore_errors=True)
        save.mkdir(parents=True)
        started = time.time()
        train(args.workers, flags, save / "train.log")
        (save / ".flags").write_text(signature)
        (save / ".done").write_text(f"{time.time() - started:.1f} s\n")
    return save / "checkpoint_last.pt"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the main job's WORK (recipes/main.sh)")
    parser.add_argument("--pruning", type=Path, required=True, help="recipes/prune_by_dialect.py's --out")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--weight", type=float, default=0.5, help="--distill-weight")
    parser.add_argument("--temperature", type=float, default=1.0, help="--distill-temperature")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--no-plain", action="store_true", help="leave out the fine-tuning without the teacher")
    parser.add_argument("--dialects", nargs="+", help="heal only these dialects' sets (all the test set's by default)")
    args = parser.parse_args(argv)
    work, out = args.work.resolve(), args.pruning.resolve()
    common = (work / "common_args.txt").read_text().splitlines()
    pruned_bleu = json.loads((out / "results.json").read_text())
    labels = (work / "data/raw/test.domain").read_text().splitlines()
    refs = (work / "data/raw/test.tgt").read_text().splitlines()
    dialects = list(dict.fromkeys(labels))
    unknown = sorted(set(args.dialects or ()) - set(dialects))
    if unknown:
        parser.error(f"--dialects {' '.join(unknown)}: not a dialect of the test set (it has {' '.join(dialects)})")
    dialects = [d for d in dialects if d in (args.dialects or dialects)]
    teacher = work / "moe/ckpt/checkpoint_best.pt"
    heal = out / "heal"
    rows = {}
    for fraction in args.fractions:
        tag = f"keep{fraction:g}"
        for d in dialects:
            data = dialect_data(work, heal, d)
            pruned = out / "sets" / f"{d}_{tag}" / "checkpoint.pt"
            own = [r for r, lab in zip(refs, labels) if lab == d]
            row = {"full": pruned_bleu["full"][d], "pruned": pruned_bleu["by_fraction"][str(fraction)][d]["dialect"]}
            for kind, by in (("healed", teacher), ("plain", None)):
                if kind == "plain" and args.no_plain:
                    continue
                print(f"keep {100 * fraction:g}%, {d}: {kind} ({args.updates} updates)", flush=True)
                save = heal / "runs" / f"{d}_{tag}_{kind}"
                path = tune(args, common, pruned, data, save, by)  # a run made again takes its output with it
                hyps = generate(data, path, "test", save / "generate_test.out", args.beam, sentences=len(own))
                row[kind] = bleu(hyps, own)
            rows.setdefault(str(fraction), {})[d] = row
    for fraction, by_dialect in rows.items():
        kinds = [k for k in ("full", "pruned", "plain", "healed") if k in next(iter(by_dialect.values()))]
        by_dialect["mean"] = {k: statistics.mean(by_dialect[d][k] for d in dialects) for k in kinds}
    settings = {k: getattr(args, k) for k in ("updates", "lr", "warmup", "weight", "temperature", "workers", "beam")}
    (out / "healed.json").write_text(json.dumps({"by_fraction": rows, "settings": settings}, indent=1) + "\n")
    text = healed_table(rows, dialects)
    (out / "healed.md").write_text(text)
    print(text)


def healed_table(rows: dict, dialects: list) -> str:
    lines = []
    for fraction, by_dialect in rows.items():
        kinds = [k for k in ("full", "pruned", "plain", "healed") if k in by_dialect["mean"]]
        names = {"full": "full", "pruned": "pruned", "plain": "fine-tuned, labels only", "healed": "healed (distilled)"}
        lines += [f"keep {100 * float(fraction):g}%:", "", "| dialect | " + " | ".join(names[k] for k in kinds) + " |"]
        lines.append("|" + " --- |" * (1 + len(kinds)))
        for d in dialects + ["mean"]:
            lines.append(f"| {d} | " + " | ".join(f"{by_dialect[d][k]:.2f}" for k in kinds) + " |")
        full = by_dialect["mean"]["full"]
        shares = ", ".join(f"{names[k]} {by_dialect['mean'][k] / full:.1%}" for k in kinds if k != "full" and full > 0)
        lines += [
            "",
            f"keep {100 * float(fraction):g}%: of the full set's BLEU, {shares or 'none (its BLEU is 0)'}",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
