"""The tables of recipes/distillation.sh, from its runs: each under a line saying when it was measured, on how many
cores, the load average before and after (the runs share the machine with whatever else runs), and the command
that reruns it.

  students  WORK/distillation/runs/{scratch,word,seq}_<seed>/bleu.json -> students.md, students.json: test BLEU of
            the dense student from scratch, distilled word-level and sequence-level (mean ± sd over the seeds, and
            per dialect), beside the MoE teacher's
  cost      runs/cost_{plain,distilled}/train.log -> cost.md, cost.json: words per second of the dense student's
            training, plain and distilled (the teacher's forward on every batch), and the teacher's sequence-level
            generation rate (seq_data/generation_rate.txt)
  healed    WORK/pruning/healed.md (recipes/heal_pruned.py) with the same line on top

  python recipes/distill_tables.py students --work WORK --seeds 1 2 3 --load-before "..." --load-after "..." --command "..."
"""

import argparse
import datetime
import json
import os
import statistics
from pathlib import Path

from fairseq_logs import json_records

KINDS = {"scratch": "from scratch", "word": "word-level distilled", "seq": "sequence-level distilled"}


def measured(args) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%d %b %Y %H:%M UTC")
    return (
        f"Measured {when} on {os.cpu_count()} cores; load average (1, 5, 15 min) before {args.load_before}, "
        f"after {args.load_after}. Rerun: `{args.command}`\n"
    )


def spread(values) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}"


def students(args, out: Path) -> str:
    runs = {kind: [json.loads((out / "runs" / f"{kind}_{s}" / "bleu.json").read_text()) for s in args.seeds]
            for kind in KINDS}  # fmt: skip
    teacher = json.loads((args.work / "moe" / "bleu.json").read_text())
    dialects = list(teacher.get("by_domain", {}))
    lines = [measured(args), f"seeds: {' '.join(map(str, args.seeds))} (mean ± sd where more than one)", ""]
    lines.append("| model | test BLEU | " + " | ".join(dialects) + " |")
    lines.append("|" + " --- |" * (2 + len(dialects)))
    lines.append(f"| MoE teacher | {teacher['bleu']:.2f} | " + " | ".join(f"{teacher['by_domain'][d]:.2f}"
                                                                     for d in dialects) + " |")  # fmt: skip
    result = {"teacher": teacher["bleu"], "seeds": args.seeds}
    for kind, name in KINDS.items():
        scores = [r["bleu"] for r in runs[kind]]
        result[kind] = scores
        cells = [spread([r["by_domain"][d] for r in runs[kind]]) for d in dialects]
        lines.append(f"| dense student, {name} | {spread(scores)} | " + " | ".join(cells) + " |")
    scratch = statistics.mean(result["scratch"])
    gains = ", ".join(f"{KINDS[k]} {statistics.mean(result[k]) - scratch:+.2f}" for k in ("word", "seq"))
    lines += ["", f"against the student from scratch: {gains} BLEU (means over the seeds)"]
    (out / "students.json").write_text(json.dumps(result, indent=1) + "\n")
    return "\n".join(lines) + "\n"


def words_per_second(log: Path) -> float:
    """The mean of the logged train_inner words per second (fairseq's wps: target tokens per second)."""
    records = json_records(log.read_text())
    if not records:
        records = json_records(log.read_text(), "train")
    return statistics.mean(float(r.get("wps", r.get("train_wps", 0))) for r in records)


def cost(args, out: Path) -> str:
    plain = words_per_second(out / "runs" / "cost_plain" / "train.log")
    distilled = words_per_second(out / "runs" / "cost_distilled" / "train.log")
    rate = out / "seq_data" / "generation_rate.txt"
    generated = rate.read_text().strip() if rate.exists() else "not measured (run the students table first)"
    result = {"plain_wps": plain, "distilled_wps": distilled, "ratio": distilled / plain, "generation": generated}
    (out / "cost.json").write_text(json.dumps(result, indent=1) + "\n")
    return "\n".join([
        measured(args),
        "| dense student, training | words/s | against plain |",
        "| --- | --- | --- |",
        f"| plain (labels only) | {plain:.0f} | 1.00x |",
        f"| word-level distilled (the teacher's forward on every batch) | {distilled:.0f} | {distilled / plain:.2f}x |",
        "",
        f"sequence-level: the teacher translated the training source side at {generated}",
    ]) + "\n"  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("table", choices=["students", "cost", "healed"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="*", default=[1])
    parser.add_argument("--load-before", default="?")
    parser.add_argument("--load-after", default="?")
    parser.add_argument("--command", default="bash recipes/distillation.sh")
    args = parser.parse_args(argv)
    out = args.work / "distillation"
    if args.table == "healed":
        target = args.work / "pruning" / "healed.md"
        text = target.read_text()
        if not text.startswith("Measured "):
            target.write_text(measured(args) + "\n" + text)
        print(target.read_text())
        return
    text = students(args, out) if args.table == "students" else cost(args, out)
    (out / f"{args.table}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
