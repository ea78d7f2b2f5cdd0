"""The tables of recipes/balance_scope_freeze.sh, from what its runs left under WORK.

    python recipes/summarize_balance_freeze.py WORK --dialect harbor

Table 1, per seed and balance scope: test BLEU, the last validation loss, and per MoE layer the mutual
information of dialect and first-choice expert as a fraction of the dialects' entropy (routing.json); then the
mean over the seeds and the global-batch minus micro-batch difference. Table 2, the one-dialect fine-tunes:
BLEU on the fine-tuned dialect and the mean over the others, before (the run fine-tuned from, named in
finetune/from.txt, by default the first seed's micro-batch run) and after, router trained or frozen. Runs that are missing are left out; nothing is printed for a table with no run.
"""

import argparse
import glob
import json
import os
import re
import statistics

SCOPES = ("micro-batch", "global-batch")


def last_valid_loss(log_path):
    losses = re.findall(r'"valid_loss": "([0-9.]+)"', open(log_path).read()) if os.path.exists(log_path) else []
    return float(losses[-1]) if losses else None


def scope_run(run):
    bleu_path, routing_path = os.path.join(run, "moe", "bleu.json"), os.path.join(run, "routing.json")
    if not (os.path.exists(bleu_path) and os.path.exists(routing_path)):
        return None
    layers = json.load(open(routing_path))["layers"]
    return {
        "bleu": json.load(open(bleu_path))["bleu"],
        "valid_loss": last_valid_loss(os.path.join(run, "moe", "train.log")),
        "mi": {layer: values["mi_fraction"] for layer, values in layers.items()},
    }


def fmt(value, digits=2):
    return "-" if value is None else f"{round(value, digits) + 0.0:.{digits}f}"  # + 0.0: no "-0.000"


def scope_table(work):
    runs = {}
    for seed_dir in sorted(glob.glob(os.path.join(work, "seed*"))):
        seed = os.path.basename(seed_dir)[4:]
        for scope in SCOPES:
            found = scope_run(os.path.join(seed_dir, scope))
            if found is not None:
                runs[(seed, scope)] = found
    if not runs:
        return []
    layers = sorted({layer for r in runs.values() for layer in r["mi"]})
    head = ["seed", "scope", "test BLEU", "valid loss", *(f"MI {layer}" for layer in layers)]
    rows = [
        [seed, scope, fmt(r["bleu"]), fmt(r["valid_loss"], 3), *(fmt(r["mi"].get(layer), 3) for layer in layers)]
        for (seed, scope), r in sorted(runs.items())
    ]
    means = {}
    for scope in SCOPES:
        chosen = [r for (_, s), r in runs.items() if s == scope]
        if not chosen:
            continue
        losses = [r["valid_loss"] for r in chosen if r["valid_loss"] is not None]
        means[scope] = [
            statistics.mean(r["bleu"] for r in chosen),
            statistics.mean(losses) if losses else None,
            *(statistics.mean(r["mi"].get(layer, 0.0) for r in chosen) for layer in layers),
        ]
        rows.append([f"mean of {len(chosen)}", scope, fmt(means[scope][0]), fmt(means[scope][1], 3)])
        rows[-1] += [fmt(v, 3) for v in means[scope][2:]]
    if len(means) == 2:
        diff = [None if a is None or b is None else b - a for a, b in zip(means["micro-batch"], means["global-batch"])]
        rows.append(["difference", "global - micro", fmt(diff[0]), fmt(diff[1], 3), *(fmt(v, 3) for v in diff[2:])])
    return ["balance scope (MI: mutual information of dialect and first-choice expert / dialect entropy)", head, *rows]


def dialect_bleu(path, dialect):
    if not os.path.exists(path):
        return None
    by_domain = json.load(open(path))["by_domain"]
    others = [v for d, v in by_domain.items() if d != dialect]
    return by_domain.get(dialect), statistics.mean(others) if others else None


def finetune_table(work, dialect):
    named = os.path.join(work, "finetune", "from.txt")  # the main job the fine-tunes started from
    seeds = sorted(glob.glob(os.path.join(work, "seed*")))
    start = open(named).read().strip() if os.path.exists(named) else seeds[0] + "/micro-batch" if seeds else ""
    base = dialect_bleu(os.path.join(start, "moe", "bleu.json"), dialect)
    runs = {f: dialect_bleu(os.path.join(work, "finetune", f, "bleu.json"), dialect) for f in ("none", "router")}
    if base is None or not any(runs.values()):
        return []
    head = ["model", f"BLEU {dialect}", "BLEU others (mean)", f"change {dialect}", "change others"]
    rows = [["base (before fine-tuning)", fmt(base[0]), fmt(base[1]), "", ""]]
    for freeze, label in (("none", "fine-tuned, router trained"), ("router", "fine-tuned, --moe-freeze router")):
        if runs[freeze] is not None:
            got = runs[freeze]
            rows.append([label, fmt(got[0]), fmt(got[1]), f"{got[0] - base[0]:+.2f}", f"{got[1] - base[1]:+.2f}"])
    return [f"fine-tune on {dialect} alone (forgetting: the other dialects)", head, *rows]


def render(table):
    title, head, *rows = table
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    lines = [title, "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work")
    parser.add_argument("--dialect", default="harbor")
    args = parser.parse_args(argv)
    tables = [t for t in (scope_table(args.work), finetune_table(args.work, args.dialect)) if t]
    if not tables:
        raise SystemExit(f"no finished run under {args.work}: run recipes/balance_scope_freeze.sh first")
    print("\n\n".join(render(t) for t in tables))


if __name__ == "__main__":
    main()
