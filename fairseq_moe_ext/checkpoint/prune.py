"""Expert pruning for deployment (Koishekenov et al. 2023, "Memory-efficient NLLB-200: language-specific
expert pruning", arXiv:2212.09811): keep, in every MoE layer, the N experts that routing statistics
(``--moe-routing-stats``, moe/routing_stats.py) rank highest for the groups named (a language, a
domain; default all), and write an ordinary smaller set: the kept experts renumbered 0..N-1 in their
old order, the router's rows (and the balance bias's entries, the cosine router's columns) sliced
alike, shared experts and every other parameter untouched, the optimizer state dropped, and the
config's expert count set to N, so the set generates with nothing but ``--path`` and fine-tunes
with ``--moe-expert-count N``. With ``--encoder-decoder-ratio R`` (``split_by_ratio``) the encoder and
decoder MoE layers keep different numbers of experts, written as ``--encoder-moe-expert-count`` and
``--decoder-moe-expert-count``. Written by reshard's writer (``reshard.save_set``) at any world size;
its manifest and ``state["moe"]["pruned"]`` say what was kept and from which statistics.

A pruned router is the original router with the other experts' logits at -inf: softmax over the
kept experts is the softmax over all with the others at probability 0, so a token whose k choices
were all kept is routed exactly as before (tested against that oracle).
"""

import copy
import hashlib
import math
import os
from typing import Dict, List, Optional, Sequence

import torch

from ..moe.routing_stats import METRICS, RoutingStatsError, expert_scores, group_keys, read_statistics
from ..options import moe_options
from .errors import CheckpointSetError

# Per MoE layer (a state-key prefix such as encoder.layers.1.fc1): tensors with one entry per expert,
# and the dimension that holds it (everything under <prefix>.experts. has it first).
ROUTER_ROWS = {"router.wg.weight": 0, "router.balance_bias.bias": 0, "router.sim_matrix": 1}
METRIC_NAMES = {"top1": "top1", "topk": "topk", "gate-mass": "gate_mass"}


def moe_layers(full: Dict) -> Dict[str, int]:
    """Each MoE layer's state-key prefix and its expert count, from the experts' stacked tensors."""
    layers = {}
    for key in full["moe"]["expert_keys"]:
        prefix = key.rsplit(".experts.", 1)[0]
        if key in full["model"]:
            layers[prefix] = int(full["model"][key].shape[0])
    return layers


def keep_count(experts: int, top_k: int, keep: Optional[int], fraction: Optional[float]) -> int:
    """N from --keep or --keep-fraction, refused in one line where it is not a layer of k..E experts."""
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise CheckpointSetError(f"--keep-fraction {fraction:g} must be in (0, 1]: e.g. 0.5 keeps half the experts")
        keep = max(1, round(fraction * experts))
        asked = f"--keep-fraction {fraction:g} ({keep} of {experts} experts)"
    else:
        asked = f"--keep {keep}"
    if keep < top_k:
        raise CheckpointSetError(
            f"{asked} keeps fewer experts than the {top_k} each token is routed to (--moe-top-k): keep at least {top_k}"
        )
    if keep > experts:
        raise CheckpointSetError(f"{asked} keeps more experts than the {experts} each MoE layer has: keep 1..{experts}")
    return keep


def side_of(layer: str) -> str:
    """ "encoder" or "decoder": the stack an MoE layer's state-key prefix (``encoder.layers.1.fc1``) is in."""
    return layer.split(".", 1)[0]


def split_by_ratio(layers: Dict[str, int], counts: Dict[str, int], top_k: int, ratio: float, asked: str):
    """Per layer, the experts kept when the budget ``counts`` (what --keep/--keep-fraction keeps per layer)
    is split between the sides so that each encoder MoE layer keeps ``ratio`` times as many experts as each
    decoder one: T experts over L_enc encoder and L_dec decoder MoE layers, each decoder layer keeps
    b = round(T / (R * L_enc + L_dec)) and each encoder layer a = round((T - L_dec * b) / L_enc), so the total
    stays T (as closely as whole experts allow); each side must keep k..E of its experts."""
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
        raise CheckpointSetError(
            f"--encoder-decoder-ratio {ratio:g} must be a number > 0: experts kept per encoder MoE layer for each "
            f"one kept per decoder MoE layer, e.g. 3 (Koishekenov et al.'s best on NLLB-200) or 0.5"
        )
    on = {side: [layer for layer in layers if side_of(layer) == side] for side in ("encoder", "decoder")}
    if not on["encoder"] or not on["decoder"]:
        has = "encoder" if on["encoder"] else "decoder"
        raise CheckpointSetError(
            f"--encoder-decoder-ratio {ratio:g} splits the experts kept between the encoder and the decoder, but "
            f"this model has MoE layers in the {has} only: drop --encoder-decoder-ratio"
        )
    total, n_enc, n_dec = sum(counts.values()), len(on["encoder"]), len(on["decoder"])
    most = {side: min(layers[layer] for layer in on[side]) for side in on}
    decoder = math.floor(total / (ratio * n_enc + n_dec) + 0.5)
    kept = {"encoder": math.floor((total - n_dec * decoder) / n_enc + 0.5), "decoder": decoder}
    for side, n in kept.items():
        if top_k <= n <= most[side]:
            continue
        splits = [
            f"{a}:{(total - n_enc * a) // n_dec} (R {a / ((total - n_enc * a) // n_dec):.3g})"
            for a in range(top_k, most["encoder"] + 1)
            if (total - n_enc * a) % n_dec == 0 and top_k <= (total - n_enc * a) // n_dec <= most["decoder"]
        ]
        bound = (
            f"fewer than the {top_k} each token is routed to (--moe-top-k)"
            if n < top_k
            else f"more than its {most[side]}"
        )
        raise CheckpointSetError(
            f"--encoder-decoder-ratio {ratio:g} with {asked} ({total} experts over {n_enc + n_dec} MoE layers) keeps "
            f"{n} per {side} MoE layer, {bound}: the splits encoder:decoder this budget allows are "
            f"{', '.join(splits) or 'none'}; use a ratio near one of them, or keep more experts"
        )
    return {layer: kept[side_of(layer)] for layer in layers}


def check_statistics(document: Dict, stats_path: str, full: Dict, layers: Dict[str, int]) -> None:
    """The statistics must be of this model: its MoE layers, their expert counts, its set and update."""
    model = document["model"]
    fix = "count the routing of this checkpoint with fairseq-generate or fairseq-validate --moe-routing-stats"
    if model["layers"] != layers:
        differ = sorted(set(model["layers"].items()) ^ set(layers.items()))[:2]
        raise CheckpointSetError(
            f"--stats {stats_path} counts another model: its MoE layers and expert counts {model['layers']} are not "
            f"the checkpoint's {layers} (first difference {differ}); {fix}"
        )
    meta = full["moe"]
    for field in ("set_id", "num_updates"):
        theirs, ours = model.get(field), meta.get(field)
        if theirs is not None and ours is not None and theirs != ours:
            raise CheckpointSetError(
                f"--stats {stats_path} counts another checkpoint: its {field} is {theirs}, the checkpoint's is {ours}; "
                f"{fix}"
            )


def choose_experts(
    document: Dict, layers: Dict[str, int], keep: Dict[str, int], metric: str, groups: Optional[Sequence[str]]
) -> Dict[str, List[int]]:
    """Per layer, the ``keep[layer]`` experts with the highest score (ties: the lower id), in id order."""
    kept = {}
    for layer, experts in layers.items():
        present = document["layers"][layer]["groups"]
        if groups is not None and not any(g in present for g in groups):
            raise CheckpointSetError(
                f"--group {' '.join(groups)}: the statistics count none of these groups in MoE layer {layer} "
                f"(it has {sorted(present)}); name a group that reaches it, e.g. the source language for the "
                f"encoder and the target language for the decoder"
            )
        scores = expert_scores(document, layer, metric, groups)
        ranked = sorted(range(experts), key=lambda e: (-scores[e], e))
        kept[layer] = sorted(ranked[: keep[layer]])
    return kept


def prune_state(full: Dict, kept: Dict[str, List[int]], record: Dict) -> Dict:
    """``full`` with only the ``kept`` experts of each layer, renumbered, and no optimizer state."""
    model = dict(full["model"])
    for layer, ids in kept.items():
        index = torch.tensor(ids, dtype=torch.long)
        for key in [k for k in model if k.startswith(layer + ".")]:
            rest = key[len(layer) + 1 :]
            dim = 0 if rest.startswith("experts.") else ROUTER_ROWS.get(rest)
            if dim is not None:
                model[key] = model[key].index_select(dim, index).clone()
    pruned = {k: v for k, v in full.items() if k != "last_optimizer_state"}
    pruned["model"] = model
    sides = {side_of(layer): len(ids) for layer, ids in kept.items()}
    pruned["cfg"] = with_expert_count(full.get("cfg"), sides)
    if full.get("args") is not None:
        pruned["args"] = with_expert_count(full["args"], sides)
    pruned["moe"] = dict(full["moe"], optimizer_expert_slots=[], pruned=record)
    pruned["moe"].pop("set_id", None)
    return pruned


def with_expert_count(cfg, sides: Dict[str, int]):
    """A copy of a checkpoint's cfg (a dict of sections, or an argparse Namespace) with ``moe_expert_count``
    set to the experts each side keeps (``sides``: {"encoder": 6, "decoder": 2}): one count as
    --moe-expert-count alone, two as --encoder/--decoder-moe-expert-count (--moe-expert-count the larger);
    an expert-parallel size that no longer divides them is cleared."""
    if cfg is None:
        return None
    if isinstance(cfg, dict) and "moe_expert_count" not in cfg:
        out = dict(cfg)
        if out.get("model") is not None:
            out["model"] = with_expert_count(out["model"], sides)
        return out
    out = copy.copy(cfg)
    if moe_options(out, as_saved=True).moe_expert_count is None:
        return out
    equal = len(set(sides.values())) == 1
    values = {"moe_expert_count": max(sides.values())}
    for side in ("encoder", "decoder"):
        values[f"{side}_moe_expert_count"] = None if equal or side not in sides else sides[side]
    for name, value in values.items():
        if isinstance(out, dict):
            out[name] = value
        else:
            setattr(out, name, value)
    size = moe_options(out, as_saved=True).moe_expert_parallel_size
    if size is not None and any(n % int(size) for n in sides.values()):
        if isinstance(out, dict):
            out["moe_expert_parallel_size"] = None
        else:
            setattr(out, "moe_expert_parallel_size", None)
    return out


def prune(
    full: Dict,
    stats_path: str,
    *,
    keep: Optional[int],
    fraction: Optional[float],
    metric: str = "gate-mass",
    groups: Optional[Sequence[str]] = None,
    source: str = "",
    ratio: Optional[float] = None,
) -> Dict:
    """The pruned state of ``full`` (loaded whole) after the statistics at ``stats_path``; every refusal is
    one CheckpointSetError line, raised before anything is written."""
    try:
        document = read_statistics(stats_path)
    except RoutingStatsError as e:
        raise CheckpointSetError(str(e)) from None
    layers = moe_layers(full)
    check_statistics(document, stats_path, full, layers)
    if groups:
        known = group_keys(document)
        unknown = [g for g in groups if g not in known]
        if unknown:
            raise CheckpointSetError(
                f"--group {unknown[0]} is not a key of the statistics {stats_path}: use one of {known}, or drop "
                f"--group to prune for every group"
            )
    saved = moe_options((full.get("cfg") or {}).get("model") or full.get("args") or {}, as_saved=True)
    top_k = int(saved.moe_top_k or 1)
    top_k = int(document["model"].get("top_k") or top_k)
    counts = {layer: keep_count(experts, top_k, keep, fraction) for layer, experts in layers.items()}
    if ratio is not None:
        asked = f"--keep-fraction {fraction:g}" if fraction is not None else f"--keep {keep}"
        counts = split_by_ratio(layers, counts, top_k, ratio, asked)
    name = METRIC_NAMES[metric]
    assert name in METRICS
    kept = choose_experts(document, layers, counts, name, groups or None)
    with open(stats_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    record = {
        "from": source,
        "from_set_id": full["moe"].get("set_id"),
        "statistics": os.path.abspath(stats_path),
        "statistics_sha256": digest,
        "metric": metric,
        "groups": list(groups) if groups else None,
        "encoder_decoder_ratio": ratio,
        "kept": kept,
    }
    return prune_state(full, kept, record)
