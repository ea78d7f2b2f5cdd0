"""Routing statistics for expert pruning: per MoE layer, per group key (a language, a domain) and per
expert, over real tokens only, how many tokens chose the expert first (``top1``), among their k
(``topk``), and the gate mass it received (``gate_mass``: the sum of the combine weights the
expert's slots carried, the paper's "importance" when divided by the tokens).

``RoutingTally`` counts (the MoE layer calls ``add`` after routing when one is attached to it);
``statistics_document`` and ``statistics_json`` make the JSON file ``--moe-routing-stats`` names, and
``read_statistics`` reads one back as untrusted input (every field checked, one line naming it).
The schema is documented in docs/routing.md ("Routing statistics").
"""

import json
from typing import Dict, List, Optional, Sequence

import torch

from ..common.input_file import read_text
from ..common.refusal import MoEOptionError

STATS_FORMAT = "fairseq-moe-ext routing statistics v1"
METRICS = ("top1", "topk", "gate_mass")


class RoutingStatsError(MoEOptionError):
    """A routing statistics file that is not one, or does not fit the model it is used with."""


class RoutingTally:
    """Counts per (layer, group): a float64 ``[3, E]`` table, rows in the order of ``METRICS``."""

    def __init__(self):
        self.tables: Dict[str, Dict[str, torch.Tensor]] = {}
        self.tokens: Dict[str, Dict[str, int]] = {}

    def add(
        self,
        layer: str,
        num_experts: int,
        expert_index: torch.Tensor,
        gates: torch.Tensor,
        token_group: torch.Tensor,
        group_names: Sequence[str],
    ) -> None:
        """``expert_index`` ``[N, k]`` (``num_experts`` for tokens not to count: pads, dummy batches),
        ``gates`` ``[N, k]`` (the combine weights), ``token_group`` ``[N]`` (an index into ``group_names``)."""
        if expert_index.numel() == 0:
            return
        width = num_experts + 1
        index = expert_index.detach().long().cpu()
        group = token_group.detach().long().cpu().view(-1, 1)
        slots = (group * width + index).reshape(-1)
        size = len(group_names) * width
        top1 = torch.bincount((group[:, 0] * width + index[:, 0]), minlength=size).double()
        topk = torch.bincount(slots, minlength=size).double()
        mass = torch.bincount(slots, weights=gates.detach().double().cpu().reshape(-1), minlength=size)
        real = index[:, 0] < num_experts
        counted = torch.bincount(group[:, 0][real], minlength=len(group_names))
        stacked = torch.stack([top1, topk, mass]).view(3, len(group_names), width)[:, :, :num_experts]
        for g, name in enumerate(group_names):
            if counted[g] == 0:
                continue
            table = self.tables.setdefault(layer, {})
            table[name] = table.get(name, torch.zeros(3, num_experts, dtype=torch.float64)) + stacked[:, g]
            per_layer = self.tokens.setdefault(layer, {})
            per_layer[name] = per_layer.get(name, 0) + int(counted[g])

    def merge(self, other: "RoutingTally") -> None:
        """Add another worker's counts (expert-sharded inference: each worker routes its own sentences)."""
        for layer, groups in other.tables.items():
            for name, table in groups.items():
                mine = self.tables.setdefault(layer, {})
                mine[name] = mine.get(name, torch.zeros_like(table)) + table
                self.tokens.setdefault(layer, {})[name] = (
                    self.tokens.get(layer, {}).get(name, 0) + other.tokens[layer][name]
                )


def statistics_document(tally: RoutingTally, model: Dict, grouped_by: str, source: Dict) -> Dict:
    """The JSON document: ``model`` (the model's identity: ``set_id``, ``num_updates``, ``top_k``,
    ``layers`` {state-key prefix: experts}), ``grouped_by`` (how keys were assigned), ``source`` (tool,
    data, subset), and per layer and group the tokens and the three metrics per expert."""
    layers = {}
    for layer, experts in model["layers"].items():
        groups = tally.tables.get(layer, {})
        layers[layer] = {
            "side": side_of(layer),
            "groups": {
                name: {
                    "tokens": tally.tokens[layer][name],
                    **{metric: _numbers(groups[name][row]) for row, metric in enumerate(METRICS)},
                }
                for name in sorted(groups)
            },
        }
    return {"format": STATS_FORMAT, "model": model, "grouped_by": grouped_by, "source": source, "layers": layers}


def _numbers(row: torch.Tensor) -> List:
    return [int(v) if float(v).is_integer() else round(float(v), 9) for v in row.tolist()]


def side_of(layer: str) -> str:
    """``encoder.layers.1.fc1`` -> ``encoder``; a language model's layers are ``decoder``."""
    return "encoder" if layer.startswith("encoder.") else "decoder"


def statistics_json(document: Dict) -> str:
    """The file's text (fairseq_integration/routing_stats.py writes it through the checkpoints' staging)."""
    return json.dumps(document, indent=1) + "\n"


def holds_statistics(path: str) -> bool:
    """Whether the file at ``path`` begins as a statistics file does (what an output may replace)."""
    try:
        with open(path, "rb") as f:
            return STATS_FORMAT.encode() in f.read(4096)
    except OSError:
        return False


def read_statistics(path: str, flag: str = "--stats") -> Dict:
    """The statistics at ``path`` (named by ``flag``) if they are well-formed, else RoutingStatsError
    naming the field."""
    fix = "write them again with fairseq-generate or fairseq-validate --moe-routing-stats"
    text = read_text(path, flag, f"routing statistics ({fix})", RoutingStatsError)
    try:
        document = json.loads(text)
    except ValueError as e:
        raise RoutingStatsError(f"{flag} {path} is not JSON ({' '.join(str(e).split())}): {fix}") from None

    def refuse(field, expected):
        raise RoutingStatsError(f"{path}: field {field} must be {expected}; {fix}")

    if not isinstance(document, dict) or document.get("format") != STATS_FORMAT:
        refuse("format", repr(STATS_FORMAT))
    model = document.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("layers"), dict) or not model["layers"]:
        refuse("model.layers", "an object of MoE layer -> expert count")
    for layer, experts in model["layers"].items():
        if not isinstance(experts, int) or experts < 1:
            refuse(f"model.layers[{layer!r}]", "an expert count >= 1")
    layers = document.get("layers")
    if not isinstance(layers, dict) or set(layers) != set(model["layers"]):
        refuse("layers", "one entry per layer of model.layers")
    for layer, entry in layers.items():
        groups = entry.get("groups") if isinstance(entry, dict) else None
        if not isinstance(groups, dict):
            refuse(f"layers[{layer!r}].groups", "an object of group key -> counts")
        for name, counts in groups.items():
            for metric in METRICS:
                row = counts.get(metric) if isinstance(counts, dict) else None
                if not (isinstance(row, list) and len(row) == model["layers"][layer]):
                    refuse(f"layers[{layer!r}].groups[{name!r}].{metric}", f"{model['layers'][layer]} numbers")
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in row):
                    refuse(f"layers[{layer!r}].groups[{name!r}].{metric}", "numbers >= 0")
    return document


def group_keys(document: Dict) -> List[str]:
    """Every group key the statistics hold, in any layer."""
    return sorted({name for entry in document["layers"].values() for name in entry["groups"]})


def expert_scores(document: Dict, layer: str, metric: str, groups: Optional[Sequence[str]]) -> List[float]:
    """A layer's per-expert score: each group's ``metric`` as shares of that group's total (so that every
    group named weighs the same, whatever its token count), summed over ``groups`` (None: all)."""
    experts = document["model"]["layers"][layer]
    totals = [0.0] * experts
    entry = document["layers"][layer]["groups"]
    for name in entry if groups is None else groups:
        row = entry.get(name)
        if row is None:  # a group that never reached this layer (e.g. a decoder-only key)
            continue
        mass = float(sum(row[metric])) or 1.0
        totals = [t + v / mass for t, v in zip(totals, row[metric])]
    return totals
