"""Plot each MoE layer's expert load over training from a fairseq-train log.

Reads the ``--log-format json`` ``train_inner`` records (what the MoE criterions log:
``moe_load_<layer>_e<i>``, each expert's share of the layer's token-slots in that log interval)
and draws one panel per layer, one line per expert, with the balanced share 1/E for reference,
plus a panel with the balance loss, the imbalance (largest share x E) and the dropped fraction.

  python recipes/plot_expert_load.py train.log --png expert_load.png
"""

import argparse
import re
from collections import defaultdict
from pathlib import Path

from fairseq_logs import json_records

LOAD = re.compile(r"^moe_load_(.+)_e(\d+)$")


def train_records(log: str) -> list:
    return json_records(log, "train_inner")


def load_series(records: list):
    """{layer: {expert: [(update, share), ...]}} in the logs' order."""
    series = defaultdict(lambda: defaultdict(list))
    for record in records:
        update = int(record["num_updates"])
        for key, value in record.items():
            match = LOAD.match(key)
            if match:
                series[match.group(1)][int(match.group(2))].append((update, float(value)))
    return series


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--title", default="expert load during training")
    args = parser.parse_args(argv)

    records = train_records(args.log.read_text(errors="replace"))
    series = load_series(records)
    if not series:
        raise SystemExit(
            f"{args.log}: no moe_load_* fields in train_inner records (was it an MoE criterion "
            "with --log-format json and without --moe-hide-expert-load?)"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(series, key=lambda name: (not name.startswith("enc"), name))
    panels = len(layers) + 1
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.8), squeeze=False)
    colors = plt.get_cmap("tab10" if max(len(series[layer]) for layer in layers) <= 10 else "tab20")
    for ax, layer in zip(axes[0], layers):
        experts = series[layer]
        for e in sorted(experts):
            updates, shares = zip(*experts[e])
            ax.plot(updates, shares, label=f"e{e}", color=colors(e), linewidth=1.3)
        ax.axhline(1 / len(experts), color="black", linestyle="--", linewidth=1, label="1/E")
        ax.set_title(f"{layer}: share of token-slots per expert", fontsize=10)
        ax.set_xlabel("update")
        ax.set_ylim(0, max(2.5 / len(experts), max(s for e in experts.values() for _, s in e) * 1.1))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share")
    axes[0][len(layers) - 1].legend(fontsize=7, ncol=2, loc="upper right")

    ax = axes[0][-1]
    updates = [int(r["num_updates"]) for r in records]
    for key, label, style in (
        ("moe_gate_loss", "balance loss (1 = balanced)", "-"),
        ("moe_imbalance", "imbalance (max share x E)", "-"),
        ("moe_dropped_frac", "dropped fraction", ":"),
    ):
        if key in records[0]:
            ax.plot(updates, [float(r[key]) for r in records], style, label=label, linewidth=1.3)
    ax.set_title("balance", fontsize=10)
    ax.set_xlabel("update")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    plt.close(fig)
    print(f"wrote {args.png}: {len(records)} log records, layers {', '.join(layers)}")


if __name__ == "__main__":
    main()
