"""Expert pruning on the main job's corpus: for each dialect, the model pruned for that dialect against
the full model, global pruning and random pruning at the same sizes, on that dialect's test sentences.

Reads a finished main job (recipes/main.sh; recipes/expert_pruning.sh runs both), then:

1. routing statistics of the MoE on the *valid* split, grouped by dialect (fairseq-generate
   --moe-routing-stats --moe-routing-stats-groups valid.domain): held out from the test set;
2. per keep fraction F: one set pruned for every dialect together (global: no --group), one per
   dialect (--group <dialect>), and one per seed with experts drawn at random (the same prune tool,
   given statistics of random scores), each written by ``python -m fairseq_moe_ext.checkpoint prune``;
3. fairseq-generate (one process) of each set: the full, global and random ones on the whole test
   set, each dialect's own set on that dialect's test sentences (a test subset of their own, binarized
   with the same dictionaries); sacreBLEU per dialect;
4. a table (``table.md``), the numbers (``results.json``) and a plot (``pruning.png``) under OUT.

  python recipes/prune_by_dialect.py --work work-dirs/main --out work-dirs/main/pruning \
      [--fractions 0.5 0.25] [--seeds 3] [--metric gate-mass] [--beam 5] [--ratios 0.333 3]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import sacrebleu

from score_translations import hypotheses

BIN = Path(sys.executable).parent
USER_DIR = str(Path(__file__).resolve().parent.parent / "fairseq_moe_ext")


def run(command, log: Path) -> None:
    with open(log, "w") as out:
        done = subprocess.run([str(c) for c in command], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"failed ({log}): {' '.join(map(str, command))}\n" + "\n".join(log.read_text().splitlines()[-15:]))


def generate(data: Path, path: Path, subset: str, out: Path, beam: int, extra=(), sentences=None) -> list:
    """The detokenized hypotheses of ``subset`` in sentence order (cached in ``out``), one per sentence."""
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        command = [BIN / "fairseq-generate", data, "--user-dir", USER_DIR, "--path", path, "--cpu", "--gen-subset"]
        # --required-batch-size-multiple 1: with fewer sentences than its default 8, fairseq makes no batch at all
        command += [subset, "--beam", beam, "--batch-size", 128, "--required-batch-size-multiple", 1]
        command += ["--remove-bpe", "sentencepiece", "--num-workers", 0]
        run([*command, *extra], tmp)
        tmp.rename(out)
    found = sum(line.startswith("H-") for line in out.read_text().splitlines())
    if sentences is not None and found != sentences:
        sys.exit(f"{out}: {found} hypotheses for the {sentences} sentences of {subset}")
    return hypotheses(out.read_text())


def bleu(hyps, refs) -> float:
    return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def split_test_by_dialect(work: Path, out: Path, dialects: list) -> Path:
    """The test set binarized once more with one subset per dialect (test, test1, ...; fairseq-preprocess
    numbers extra --testpref prefixes), with the main job's dictionaries."""
    data = out / "bin"
    if (data / ".done").exists():
        return data
    labels = (work / "data/raw/test.domain").read_text().splitlines()
    prefixes = []
    for d, dialect in enumerate(dialects):
        prefix = out / "tok" / f"test.{dialect}"
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for side in ("src", "tgt"):
            lines = (work / f"data/tok/test.{side}").read_text().splitlines()
            Path(f"{prefix}.{side}").write_text("".join(x + "\n" for x, lab in zip(lines, labels) if lab == dialect))
        prefixes.append(str(prefix))
    bin_dir = work / "data/bin"
    run(
        [BIN / "fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--testpref", ",".join(prefixes)]
        + ["--srcdict", bin_dir / "dict.src.txt", "--tgtdict", bin_dir / "dict.tgt.txt", "--destdir", data]
        + ["--workers", 1],
        out / "preprocess.log",
    )
    (data / ".done").write_text("")
    return data


def prune(work: Path, out: Path, name: str, stats: Path, fraction: float, metric: str, groups=(), ratio=None):
    """The pruned set's path; with ``ratio`` (--encoder-decoder-ratio), None where prune refuses the split."""
    path = out / "sets" / name / "checkpoint.pt"
    if not (path.parent / "checkpoint.set.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "fairseq_moe_ext.checkpoint", "prune", work / "moe/ckpt/checkpoint_best.pt"]
        command += [path, "--stats", stats, "--keep-fraction", fraction, "--metric", metric]
        command += [a for g in groups for a in ("--group", g)]
        command += [] if ratio is None else ["--encoder-decoder-ratio", ratio]
        log = out / "sets" / f"{name}.log"
        if ratio is not None:  # a split the budget does not allow is refused in one line: no point measured
            with open(log, "w") as f:
                if subprocess.run([str(c) for c in command], stdout=f, stderr=subprocess.STDOUT).returncode:
                    return None
        else:
            run(command, log)
    return path


def split_of(path: Path) -> str:
    """The experts each side kept, from the pruned set's manifest: "encoder:decoder", e.g. "6:2"."""
    kept = json.loads((path.parent / "checkpoint.set.json").read_text())["pruned"]["kept"]
    sides = {layer.split(".")[0]: len(ids) for layer, ids in kept.items()}
    return f"{sides.get('encoder', 0)}:{sides.get('decoder', 0)}"


def per_side_budgets(args, work, out, stats, data, by_dialect_data, per_dialect, labels, refs, dialects) -> list:
    """Per-dialect and global pruning at each keep fraction split between the sides by each --ratios R
    (prune --encoder-decoder-ratio): one row per split the budget allows (ratios giving the same split share it)."""
    rows, gen = [], out / "generate"
    for fraction in args.ratio_fractions or args.fractions:
        seen = set()
        for ratio in args.ratios:
            tag = f"keep{fraction:g}_r{ratio:g}"
            glob_path = prune(work, out, f"global_{tag}", stats, fraction, args.metric, ratio=ratio)
            cached = all((gen / f"{d}_{tag}.out").exists() for d in dialects)
            if glob_path is None or split_of(glob_path) in seen or (args.ratio_cached_only and not cached):
                continue
            seen.add(split_of(glob_path))
            print(f"keep {100 * fraction:g}%, encoder:decoder {split_of(glob_path)} (R {ratio:g})", flush=True)
            glob = None
            if args.ratio_global:
                glob_out = gen / f"global_{tag}.out"
                glob = per_dialect(generate(data, glob_path, "test", glob_out, args.beam, sentences=len(refs)))
            own = {}
            for d_index, d in enumerate(dialects):
                path = prune(work, out, f"{d}_{tag}", stats, fraction, args.metric, [d], ratio=ratio)
                subset = "test" if d_index == 0 else f"test{d_index}"
                own_out = gen / f"{d}_{tag}.out"
                hyps = generate(by_dialect_data, path, subset, own_out, args.beam, sentences=labels.count(d))
                own[d] = bleu(hyps, [r for r, lab in zip(refs, labels) if lab == d])
            rows.append(
                {"fraction": fraction, "ratio": ratio, "split": split_of(glob_path), "dialect": own, "global": glob}
            )
    return rows


def budgets_table(rows: list, full: dict, dialects: list) -> str:
    lines = ["| keep | R | experts kept enc:dec | per-dialect BLEU (% of full) | global BLEU (% of full) |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for row in rows:
        cells = []
        for kind in ("dialect", "global"):
            if row[kind] is None:
                cells.append("not measured")
                continue
            mean = statistics.mean(row[kind][d] for d in dialects)
            cells.append(f"{mean:.2f} ({mean / max(full['mean'], 1e-9):.1%})")
        lines.append(f"| {100 * row['fraction']:g}% | {row['ratio']:g} | {row['split']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def random_statistics(stats: Path, seed: int, out: Path) -> Path:
    """The statistics with every count replaced by a random score: pruning by them keeps random experts."""
    document = json.loads(stats.read_text())
    rng = random.Random(seed)
    for entry in document["layers"].values():
        scores = None
        for counts in entry["groups"].values():
            scores = scores or [rng.random() for _ in counts["gate_mass"]]
            for metric in ("top1", "topk", "gate_mass"):
                counts[metric] = list(scores)
    document["grouped_by"] = f"random scores, seed {seed}"
    path = out / f"random_{seed}.json"
    path.write_text(json.dumps(document))
    return path


def plot(results: dict, fractions: list, dialects: list, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [("dialect", "per-dialect"), ("global", "global"), ("random", "random (mean of seeds)")]
    fig, axes = plt.subplots(1, len(fractions), figsize=(5.5 * len(fractions), 3.8), squeeze=False, sharey=True)
    for ax, fraction in zip(axes[0], fractions):
        row = results["by_fraction"][str(fraction)]
        width = 0.8 / len(kinds)
        for i, (kind, label) in enumerate(kinds):
            values = [100 * row[d][kind] / max(results["full"][d], 1e-9) for d in dialects]
            ax.bar([x + (i - 1) * width for x in range(len(dialects))], values, width, label=label)
        ax.axhline(100, color="black", linewidth=0.8)
        ax.set_xticks(range(len(dialects)), dialects, rotation=45, fontsize=8)
        ax.set_title(f"keep {100 * fraction:g}% of the experts", fontsize=10)
        ax.set_ylabel("BLEU, % of the full model")
    axes[0][-1].legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def table(results: dict, fractions: list, dialects: list) -> str:
    lines = [
        "| dialect | full | "
        + " | ".join(f"{k} {100 * f:g}%" for f in fractions for k in ("dialect", "global", "random"))
        + " |"
    ]
    lines.append("|" + " --- |" * (2 + 3 * len(fractions)))
    for d in dialects + ["mean"]:
        cells = [f"{results['full'][d]:.2f}"]
        for f in fractions:
            row = results["by_fraction"][str(f)][d]
            drawn = (
                "not measured" if row["random"] != row["random"] else f"{row['random']:.2f} ± {row['random_sd']:.2f}"
            )
            cells += [f"{row['dialect']:.2f}", f"{row['global']:.2f}", drawn]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    for f in fractions:
        row = results["by_fraction"][str(f)]["mean"]
        beats = f"per-dialect beats random on {row['dialect_beats_random']} of {len(dialects)} dialects"
        versus = f"random {row['random_share']:.1%}; {beats}" if row["random_seeds"] else "random not measured"
        lines.append(
            f"\nkeep {100 * f:g}%: per-dialect {row['dialect_share']:.1%} of the full BLEU, global "
            f"{row['global_share']:.1%}, {versus} (random: {row['random_seeds']} seeds)"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the main job's WORK (recipes/main.sh)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--seeds", type=int, default=3, help="random prunings per keep fraction")
    parser.add_argument("--metric", default="gate-mass", choices=["top1", "topk", "gate-mass"])
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="*",
        default=[],
        help="encoder:decoder ratios R (prune --encoder-decoder-ratio) to measure per-dialect pruning at, for each "
        "keep fraction: a second table (budgets.md); splits a budget does not allow are left out",
    )
    parser.add_argument(
        "--ratio-global", action="store_true", help="measure global pruning at each ratio too (the whole test set)"
    )
    parser.add_argument("--ratio-fractions", type=float, nargs="*", default=[], help="keep fractions --ratios uses")
    parser.add_argument("--ratio-cached-only", action="store_true", help="only the ratios' splits generated already")
    parser.add_argument(
        "--random-cached-only",
        action="store_true",
        help="use only the random prunings already generated (of the first --seeds): their sets often generate to "
        "the length limit, which is slow",
    )
    args = parser.parse_args(argv)
    work, out = args.work.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data, full_path = work / "data/bin", work / "moe/ckpt/checkpoint_best.pt"
    labels = (work / "data/raw/test.domain").read_text().splitlines()
    refs = (work / "data/raw/test.tgt").read_text().splitlines()
    dialects = list(dict.fromkeys(labels))

    stats = out / "routing_valid.json"
    if not stats.exists():
        print(f"routing statistics of the valid split by dialect -> {stats}", flush=True)
        groups = ["--moe-routing-stats", stats, "--moe-routing-stats-groups", work / "data/raw/valid.domain"]
        generate(data, full_path, "valid", out / "generate_valid.out", args.beam, groups)
    by_dialect_data = split_test_by_dialect(work, out, dialects)

    def per_dialect(hyps):
        return {
            d: bleu([h for h, lab in zip(hyps, labels) if lab == d], [r for r, lab in zip(refs, labels) if lab == d])
            for d in dialects
        }

    gen = out / "generate"
    gen.mkdir(exist_ok=True)
    full = per_dialect(generate(data, full_path, "test", gen / "full.out", args.beam, sentences=len(refs)))
    results = {
        "full": dict(full, mean=statistics.mean(full.values())),
        "by_fraction": {},
        "settings": {
            "fractions": args.fractions,
            "seeds": args.seeds,
            "metric": args.metric,
            "beam": args.beam,
            "statistics": "valid split, fairseq-generate, grouped by dialect",
        },
    }
    for fraction in args.fractions:
        tag = f"keep{fraction:g}"
        print(f"keep {100 * fraction:g}%: global, per dialect, {args.seeds} random", flush=True)
        glob_path = prune(work, out, f"global_{tag}", stats, fraction, args.metric)
        global_bleu = per_dialect(
            generate(data, glob_path, "test", gen / f"global_{tag}.out", args.beam, sentences=len(refs))
        )
        own_bleu = {}
        for d_index, d in enumerate(dialects):
            path = prune(work, out, f"{d}_{tag}", stats, fraction, args.metric, [d])
            subset = "test" if d_index == 0 else f"test{d_index}"
            own = labels.count(d)
            hyps = generate(by_dialect_data, path, subset, gen / f"{d}_{tag}.out", args.beam, sentences=own)
            own_bleu[d] = bleu(hyps, [r for r, lab in zip(refs, labels) if lab == d])
        randoms = []
        for seed in range(1, args.seeds + 1):
            if args.random_cached_only and not (gen / f"random{seed}_{tag}.out").exists():
                continue  # a random set generates to the length limit, which is slow: left out, and said so
            path = prune(work, out, f"random{seed}_{tag}", random_statistics(stats, seed, out), fraction, "gate-mass")
            out_file = gen / f"random{seed}_{tag}.out"
            randoms.append(per_dialect(generate(data, path, "test", out_file, args.beam, sentences=len(refs))))
        row = {}
        for d in dialects:
            random_scores = [r[d] for r in randoms] or [float("nan")]
            row[d] = {
                "dialect": own_bleu[d],
                "global": global_bleu[d],
                "random": statistics.mean(random_scores),
                "random_sd": statistics.pstdev(random_scores) if randoms else float("nan"),
                "random_seeds": random_scores,
            }
        mean = {kind: statistics.mean(row[d][kind] for d in dialects) for kind in ("dialect", "global", "random")}
        mean["random_sd"] = statistics.mean(row[d]["random_sd"] for d in dialects)
        for kind in ("dialect", "global", "random"):
            mean[f"{kind}_share"] = mean[kind] / max(results["full"]["mean"], 1e-9)
        mean["dialect_beats_random"] = sum(row[d]["dialect"] > row[d]["random"] for d in dialects)
        mean["random_seeds"] = len(randoms)
        row["mean"] = mean
        results["by_fraction"][str(fraction)] = row
    if args.ratios:
        rows = per_side_budgets(args, work, out, stats, data, by_dialect_data, per_dialect, labels, refs, dialects)
        results["per_side_budgets"] = rows
        (out / "budgets.md").write_text(budgets_table(rows, results["full"], dialects))
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results, args.fractions, dialects)
    (out / "table.md").write_text(text)
    experts = json.loads(stats.read_text())["model"]["layers"]
    title = (
        f"expert pruning by dialect ({len(dialects)} dialects, {max(experts.values())} experts per layer, "
        f"metric {args.metric}, statistics from the valid split)"
    )
    plot(results, args.fractions, dialects, out / "pruning.png", title)
    print(text + f"plot: {out / 'pruning.png'}")
    if args.ratios:
        print("\nper-side budgets (--encoder-decoder-ratio):\n" + (out / "budgets.md").read_text())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
