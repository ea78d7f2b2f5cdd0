"""Language-model summary: validation and test perplexity of each run, side by side.

Each run directory holds ``train.log`` (fairseq-train, ``--log-format json``), ``eval_valid.log``
and ``eval_test.log`` (fairseq-eval-lm output) and ``ckpt/checkpoint_best.pt``. Perplexities are
per token of the shared tokenizer, so runs on the same data compare directly.

  python recipes/summarize_lm.py --run MoE work/moe --run dense work/dense --out work/summary.txt
"""

import argparse
import json
import re
from pathlib import Path

from summarize_translation import parameter_counts, records

EVAL = re.compile(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)")


def evaluation(log_file: Path):
    match = EVAL.search(log_file.read_text(errors="replace")) if log_file.exists() else None
    return (float(match.group(1)), float(match.group(2))) if match else (float("nan"), float("nan"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", nargs=2, action="append", metavar=("NAME", "DIR"), required=True)
    parser.add_argument("--title", default="language model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)

    runs = []
    for name, directory in args.run:
        directory = Path(directory)
        train = records(directory / "train.log", "train_inner")
        total, active, experts, k = parameter_counts(directory / "ckpt" / "checkpoint_best.pt")
        runs.append(
            {
                "name": name,
                "valid": evaluation(directory / "eval_valid.log"),
                "test": evaluation(directory / "eval_test.log"),
                "total": total,
                "active": active,
                "experts": experts,
                "k": k,
                "updates": train[-1].get("num_updates", "?") if train else "?",
                "wall": train[-1].get("wall", "?") if train else "?",
                "last": train[-1] if train else {},
            }
        )

    lines = [args.title, ""]

    def row(label, values):
        lines.append(f"{label:<30}" + "".join(f"{str(v):>16}" for v in values))

    row("", [r["name"] for r in runs])
    row("valid perplexity (eval-lm)", [f"{r['valid'][1]:.2f}" for r in runs])
    row("test perplexity (eval-lm)", [f"{r['test'][1]:.2f}" for r in runs])
    row("test loss (base 2)", [f"{r['test'][0]:.4f}" for r in runs])
    row("parameters, total", [f"{r['total']:,}" for r in runs])
    row("parameters, active per token", [f"{r['active']:,}" for r in runs])
    row("experts per MoE layer, top-k", [f"{r['experts']}, k={r['k']}" if r["experts"] else "-" for r in runs])
    row("updates", [r["updates"] for r in runs])
    row("training wall time (s)", [r["wall"] for r in runs])
    moe = next((r for r in runs if r["experts"]), None)
    if moe and moe["last"]:
        last = moe["last"]
        lines += [
            "",
            f"{moe['name']} routing over the last log interval of training: balance loss "
            f"{last.get('moe_gate_loss', '?')} (1.0 = balanced), imbalance {last.get('moe_imbalance', '?')}, "
            f"dropped fraction {last.get('moe_dropped_frac', '?')}",
        ]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    if args.json_out:
        args.json_out.write_text(
            json.dumps([{k: v for k, v in r.items() if k != "last"} for r in runs], indent=1) + "\n"
        )
    print(text, end="")


if __name__ == "__main__":
    main()
