"""The main job's summary: MoE vs the dense baselines, side by side, from what the earlier stages wrote.

Each run directory holds ``train.log`` (fairseq-train, ``--log-format json``), ``bleu.json``
(score_translations.py) and ``ckpt/checkpoint_best.pt`` (a per-rank set or a single file; fairseq's
loader, as patched by the plugin, merges a set given by its manifest). Parameters and forward FLOPs per token
are counted from the checkpoint (model_cost.py says what is counted); a token's *active* parameters count k of
the E experts in each MoE layer. When a dense run has at least the MoE's FLOPs per token and no higher BLEU,
the summary says so in words: the MoE then did not beat a dense model of equal compute.

  python recipes/summarize_translation.py --run MoE work/moe --run dense work/dense \
      --run dense_matched work/dense_matched [--run upcycled work/upcycled --upcycled upcycled 300] \
      --routing work/routing.json --out work/summary.txt

``--upcycled NAME N``: run NAME is an MoE upcycled from the dense checkpoint of update N (sparse
upcycling); its updates count those N, and it is compared with every other run at equal updates.
"""

import argparse
import json
from pathlib import Path

from fairseq import checkpoint_utils
from fairseq_logs import json_records
from fairseq_moe_ext import checkpoint as moe_checkpoint
from model_cost import model_cost
from routing_extensions import effect_lines, routing_features


def records(log_file: Path, kind: str) -> list:
    return json_records(log_file.read_text(errors="replace"), kind)


def checkpoint_cost(checkpoint: Path) -> dict:
    """model_cost() of a checkpoint's model state, with its experts E and top-k (None when dense)."""
    # fairseq's loader takes a set by its manifest (and merges it); resolve() finds the manifest
    # or the single file that the rank-less name stands for.
    state = checkpoint_utils.load_checkpoint_to_cpu(moe_checkpoint.resolve(str(checkpoint)).path)
    model_cfg = state["cfg"]["model"]
    tensors = {k: v for k, v in state["model"].items() if not k.endswith((".version", "_float_tensor"))}
    expert_keys = set(state.get("moe", {}).get("expert_keys", []))
    experts = getattr(model_cfg, "moe_expert_count", None) if expert_keys else None
    k = getattr(model_cfg, "moe_top_k", None) if expert_keys else None
    return dict(
        model_cost(tensors, expert_keys, experts, k),
        experts=experts,
        k=k,
        features=routing_features(model_cfg, state["model"]),
    )


def parameter_counts(checkpoint: Path):
    """(total, active per token, experts E, top-k) from a checkpoint's model state."""
    cost = checkpoint_cost(checkpoint)
    return cost["total"], cost["active"], cost["experts"], cost["k"]


def describe(name: str, directory: Path) -> dict:
    train = records(directory / "train.log", "train_inner")
    valid = records(directory / "train.log", "valid")
    bleu = json.loads((directory / "bleu.json").read_text())
    cost = checkpoint_cost(directory / "ckpt" / "checkpoint_best.pt")
    best = min(valid, key=lambda r: float(r["valid_loss"])) if valid else {}
    last = train[-1] if train else {}
    return {
        "name": name,
        "bleu": bleu,
        **cost,
        "flops": cost["encoder_flops"] + cost["decoder_flops"],
        "updates": last.get("num_updates", "?"),
        "wall": last.get("wall", "?"),
        "valid_nll": best.get("valid_nll_loss", best.get("valid_loss", "?")),
        "valid_ppl": best.get("valid_ppl", "?"),
        "last": last,
    }


def comparisons(moe: dict, dense_runs: list) -> list:
    """One line per dense run: the BLEU difference, and whether the MoE beat equal (or more) compute."""
    lines = []
    for dense in dense_runs:
        gain = moe["bleu"]["bleu"] - dense["bleu"]["bleu"]
        compute = dense["flops"] / moe["flops"]
        if compute < 1:
            verdict = f"the dense model spends only {compute:.0%} of the MoE's FLOPs per token"
        elif gain > 0:
            verdict = f"the MoE beats a dense model with {compute:.0%} of its FLOPs per token"
        else:
            verdict = (
                f"the MoE does NOT beat a dense model with {compute:.0%} of its FLOPs per token: "
                "at equal compute its extra experts bought no BLEU here"
            )
        lines.append(f"  {moe['name']} - {dense['name']}: {gain:+.2f} BLEU; {verdict}")
    return lines


def upcycled_comparisons(upcycled: dict, dense_updates: int, others: list) -> list:
    """The upcycled MoE against every other run, each at its own total of updates (equal in the main job)."""
    lines = [
        f"{upcycled['name']}: {dense_updates} dense updates, then {upcycled['updates']} as an MoE upcycled from "
        f"that checkpoint (sparse upcycling; every expert started as a copy of the dense FFN)"
    ]
    for other in others:
        gain = upcycled["bleu"]["bleu"] - other["bleu"]["bleu"]
        lines.append(
            f"  {upcycled['name']} - {other['name']}: {gain:+.2f} BLEU at {upcycled['total_updates']} vs "
            f"{other['total_updates']} updates"
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", nargs=2, action="append", metavar=("NAME", "DIR"), required=True)
    parser.add_argument("--routing", type=Path, help="routing_by_domain.py's JSON output")
    parser.add_argument(
        "--upcycled",
        nargs=2,
        metavar=("NAME", "DENSE_UPDATES"),
        help="run NAME was upcycled from the dense checkpoint of update DENSE_UPDATES",
    )
    parser.add_argument("--title", default="main job")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)

    runs = [describe(name, Path(directory)) for name, directory in args.run]
    upcycled_name, dense_updates = (args.upcycled[0], int(args.upcycled[1])) if args.upcycled else (None, 0)
    for r in runs:
        before = dense_updates if r["name"] == upcycled_name else 0
        r["total_updates"] = before + int(r["updates"]) if str(r["updates"]).isdigit() else r["updates"]
    width = 16
    lines = [args.title, ""]

    def row(label, values):
        lines.append(f"{label:<30}" + "".join(f"{str(v):>{width}}" for v in values))

    row("", [r["name"] for r in runs])
    row("test BLEU (sacrebleu)", [f"{r['bleu']['bleu']:.2f}" for r in runs])
    for domain in runs[0]["bleu"].get("by_domain", {}):
        row(f"  {domain}", [f"{r['bleu'].get('by_domain', {}).get(domain, float('nan')):.2f}" for r in runs])
    row("best valid nll loss (base 2)", [r["valid_nll"] for r in runs])
    row("best valid ppl", [r["valid_ppl"] for r in runs])
    row("parameters, total", [f"{r['total']:,}" for r in runs])
    row("parameters, active per token", [f"{r['active']:,}" for r in runs])
    row("FLOPs per token, encoder", [f"{r['encoder_flops']:,}" for r in runs])
    row("FLOPs per token, decoder", [f"{r['decoder_flops']:,}" for r in runs])
    row("experts per MoE layer, top-k", [f"{r['experts']}, k={r['k']}" if r["experts"] else "-" for r in runs])
    row("updates", [f"{dense_updates}+{r['updates']}" if r["name"] == upcycled_name else r["updates"] for r in runs])
    row("training wall time (s)", [r["wall"] for r in runs])

    moe = next((r for r in runs if r["experts"] and r["name"] != upcycled_name), None)
    if moe:
        lines += [
            "",
            "forward FLOPs per token: 2 x the weight-matrix elements a token is multiplied by (its k experts,",
            "not all E); attention scores, biases and norms not counted (recipes/model_cost.py)",
        ]
        lines += comparisons(moe, [r for r in runs if not r["experts"]])
        for base in (r for r in runs if r["experts"] and r is not moe and r["name"] != upcycled_name):
            lines += effect_lines(moe, base)
        last = moe["last"]
        lines += ["", f"{moe['name']} routing over the last log interval of training:"]
        lines.append(
            f"  balance loss {last.get('moe_gate_loss', '?')} (1.0 = perfectly balanced, E = collapsed onto one expert)"
        )
        lines.append(f"  imbalance {last.get('moe_imbalance', '?')} (busiest expert's share x E; 1.0 = balanced)")
        lines.append(
            f"  dropped fraction {last.get('moe_dropped_frac', '?')} (token-slots over capacity; the residual carries them)"
        )
        lines.append(f"  router entropy {last.get('moe_router_entropy', '?')} nats per token")
    upcycled = next((r for r in runs if r["name"] == upcycled_name), None)
    if upcycled:
        lines += [""] + upcycled_comparisons(upcycled, dense_updates, [r for r in runs if r is not upcycled])
    if args.routing and args.routing.exists():
        routing = json.loads(args.routing.read_text())
        lines += ["", "routing by domain on the test set (I = mutual information of domain and first-choice expert):"]
        for layer, data in routing["layers"].items():
            favourite = [
                f"{d}->e{max(range(len(s)), key=s.__getitem__)}" for d, s in zip(routing["domains"], data["share"])
            ]
            lines.append(f"  {layer}: I = {data['mi_fraction']:.0%} of H(domain); most used: {', '.join(favourite)}")
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    if args.json_out:
        args.json_out.write_text(
            json.dumps({r["name"]: {k: v for k, v in r.items() if k != "last"} for r in runs}, indent=1) + "\n"
        )
    print(text, end="")


if __name__ == "__main__":
    main()
