"""Which experts does each domain use? A domain-by-expert routing matrix per MoE layer.

Loads a trained translation model through fairseq's own loader (a per-rank checkpoint set loads
merged, every expert in this one process), runs it with teacher forcing over one split, one
domain at a time, and records every MoE router's choices with a forward hook on the router
(the hook sees real tokens only: the layer drops pads before routing). Counts are token-slots
(k per token), the same unit as the ``moe_load_*`` training logs.

Writes a heatmap per MoE layer (rows: domains, columns: experts, cells: the domain's share of
slots sent to the expert) and a JSON file with the matrices and, per layer, the mutual information
between a token's domain and its first-choice expert, as a fraction of the domain entropy (0: the
router ignores the domain; 1: the first-choice expert tells you the domain).

  python recipes/routing_by_domain.py --data BIN --path CKPT/checkpoint_best.pt \
      --domains test.domain --subset test --png routing.png --json-out routing.json
"""

import argparse
import json
import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import fairseq_moe_ext  # noqa: F401  (registers the models and makes fairseq load per-rank sets)
from fairseq import checkpoint_utils
from fairseq_moe_ext.moe import MoELayer


def short_name(module_name: str) -> str:
    """``encoder.layers.1.fc1`` -> ``enc1``, the names the training logs use."""
    parts = module_name.split(".")
    return f"{parts[0][:3]}{parts[2]}" if len(parts) > 2 and parts[1] == "layers" else module_name


def record_routing(model, counts, top1, current):
    """Hook every MoE router: add its choices to counts[layer][domain] and top1[layer][domain]."""
    handles = []
    for name, module in model.named_modules():
        if not isinstance(module, MoELayer):
            continue
        layer = short_name(name)
        experts = module.num_experts

        def hook(router, inputs, routing, layer=layer, experts=experts):
            index = routing.expert_index
            domain = current["domain"]
            counts[layer][domain] += torch.bincount(index.reshape(-1), minlength=experts).double().numpy()
            top1[layer][domain] += torch.bincount(index[:, 0], minlength=experts).double().numpy()

        handles.append(module.router.register_forward_hook(hook))
    return handles


def mutual_information_fraction(joint: np.ndarray) -> float:
    """I(domain; expert) / H(domain) from a domains x experts count matrix."""
    p = joint / joint.sum()
    pd, pe = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    nz = p > 0
    mi = float((p[nz] * np.log(p[nz] / (pd @ pe)[nz])).sum())
    hd = -float((pd[pd > 0] * np.log(pd[pd > 0])).sum())
    return mi / hd if hd > 0 else 0.0


def plot(matrices: dict, domains: list, info: dict, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(matrices)
    experts = matrices[layers[0]].shape[1]
    fig, axes = plt.subplots(
        1,
        len(layers),
        figsize=(1.8 + 0.62 * experts * len(layers), 0.55 * len(domains) + 1.9),
        squeeze=False,
        sharey=True,
    )
    for ax, layer in zip(axes[0], layers):
        share = matrices[layer]
        image = ax.imshow(share, cmap="viridis", vmin=0, vmax=max(0.5, float(share.max())), aspect="auto")
        ax.set_xticks(range(experts), [str(e) for e in range(experts)])
        ax.set_yticks(range(len(domains)), domains)
        ax.set_xlabel("expert")
        ax.set_title(f"{layer}: I(domain; 1st expert) = {info[layer]:.0%} of H(domain)", fontsize=9)
        for d in range(len(domains)):
            for e in range(experts):
                value = share[d, e]
                ax.text(
                    e,
                    d,
                    f"{value:.2f}".lstrip("0"),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if value > 0.6 * max(0.5, share.max()) else "white",
                )
    fig.colorbar(image, ax=axes[0].tolist(), label="share of the domain's token-slots", shrink=0.9)
    fig.suptitle(title, fontsize=11)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="the fairseq-preprocess directory")
    parser.add_argument("--path", required=True, help="checkpoint (a per-rank set's name works as is)")
    parser.add_argument("--domains", type=Path, required=True, help="a domain label per line of the split")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--title", default="routing by domain")
    args = parser.parse_args(argv)
    # fairseq 0.12 calls logging.basicConfig(level=DEBUG) when it imports its models
    # (models/wav2vec/wav2vec2_classification.py): take the root logger back to INFO, or every
    # library's debug lines (matplotlib's, on import) reach the job's output.
    logging.basicConfig(level=logging.INFO, force=True)

    torch.set_grad_enabled(False)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([args.path], arg_overrides={"data": args.data})
    model = models[0].eval()
    task.load_dataset(args.subset)
    dataset = task.dataset(args.subset)
    labels = args.domains.read_text().splitlines()
    if len(labels) != len(dataset):
        raise SystemExit(f"{args.domains} has {len(labels)} labels for {len(dataset)} {args.subset} sentences")
    domains = list(dict.fromkeys(labels))  # first-appearance order

    counts = defaultdict(lambda: defaultdict(float))
    top1 = defaultdict(lambda: defaultdict(float))
    current = {}
    handles = record_routing(model, counts, top1, current)
    if not handles:
        raise SystemExit(f"{args.path} has no MoE layers")
    for domain in domains:
        current["domain"] = domain
        ids = [i for i, label in enumerate(labels) if label == domain]
        for start in range(0, len(ids), args.batch_size):
            batch = dataset.collater([dataset[i] for i in ids[start : start + args.batch_size]])
            model(**batch["net_input"])
    for handle in handles:
        handle.remove()

    layers = sorted(counts, key=lambda name: (not name.startswith("enc"), name))
    matrices, info = {}, {}
    for layer in layers:
        joint = np.stack([counts[layer][d] for d in domains])
        matrices[layer] = joint / joint.sum(1, keepdims=True)
        info[layer] = mutual_information_fraction(np.stack([top1[layer][d] for d in domains]))
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(matrices, domains, info, args.png, args.title)
    result = {
        "domains": domains,
        "layers": {
            layer: {"share": matrices[layer].round(4).tolist(), "mi_fraction": round(info[layer], 4)}
            for layer in layers
        },
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    for layer in layers:
        favourite = {d: int(np.argmax(matrices[layer][i])) for i, d in enumerate(domains)}
        print(
            f"{layer}: domain-expert MI {info[layer]:.2f} of H(domain); most used expert per domain: "
            + ", ".join(f"{d} e{e}" for d, e in favourite.items())
        )


if __name__ == "__main__":
    main()
