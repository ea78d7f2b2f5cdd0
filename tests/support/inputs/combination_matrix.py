"""The combination matrix of tests/parallel/test_combination_matrix.py: factors, a pairwise covering array over
them, and the pairs the plugin refuses.

Factors: the model features, one per option record that names values to cross (``Option.matrix``: a new
option joins by its record, a new router type by the scorers' registry), each with its default as a level;
the data-parallel backends (``--moe-fully-sharded-experts``' choices beside fully_sharded's default), the
layouts (W workers, P expert-parallel), the precisions and ``--update-freq``. A cell takes one level of each.
``covering_cells`` picks cells greedily until every pair of levels of two factors is in some cell (tens of
cells, where the full product is hundreds of thousands); a pair the plugin refuses (``REFUSED``) gets a cell
of its own, the pair and every other factor at its default, which must be refused in that line.
"""

from dataclasses import dataclass
from itertools import combinations
from typing import Dict, List, Optional, Tuple

from fairseq_moe_ext.options import OPTIONS


@dataclass(frozen=True)
class Level:
    factor: str
    name: str  # as the cell's id shows it
    flags: Tuple[str, ...] = ()
    world: Optional[int] = None  # the layout's W
    parallel: Optional[int] = None  # the layout's P


def feature_factors() -> List[Tuple[str, List[Level]]]:
    """One factor per option record with matrix values, its default first."""
    factors = []
    for option in OPTIONS.values():
        if not option.matrix:
            continue
        short = option.name.replace("moe_", "", 1)
        levels = [Level(short, "default")]
        for value in option.matrix:
            words = value.split()
            shown = words[0].strip("{}")
            levels.append(Level(short, f"{short}={shown}", (option.flag, *words)))
        factors.append((short, levels))
    return factors


def layout_factors() -> List[Tuple[str, List[Level]]]:
    expert_holding = OPTIONS["moe_fully_sharded_experts"]
    backends = [Level("backend", name, ("--ddp-backend", name)) for name in ("legacy_ddp", "no_c10d", "c10d")]
    backends += [Level("backend", "pytorch_ddp", ("--ddp-backend", "pytorch_ddp"))]
    backends += [Level("backend", "fully_sharded", ("--ddp-backend", "fully_sharded"))]
    for choice in expert_holding.choices:
        if choice != expert_holding.default:
            flags = ("--ddp-backend", "fully_sharded", expert_holding.flag, choice)
            backends.append(Level("backend", f"fully_sharded_{choice}", flags))
    layouts = [
        Level("layout", f"W{w}P{p}", ("--moe-expert-parallel-size", str(p)), world=w, parallel=p)
        for w, p in ((2, 2), (2, 1), (4, 4), (4, 2))
    ]
    precisions = [Level("precision", "fp32")]
    precisions += [Level("precision", "bf16", ("--bf16",))]
    precisions += [Level("precision", "fp16", ("--fp16", "--fp16-no-flatten-grads", "--fp16-init-scale", "64"))]
    update_freq = [Level("update_freq", f"uf{n}", ("--update-freq", str(n))) for n in (1, 2)]
    return [("backend", backends), ("layout", layouts), ("precision", precisions), ("update_freq", update_freq)]


def factors() -> List[Tuple[str, List[Level]]]:
    return layout_factors() + feature_factors()


# Pairs of levels the plugin refuses, each with a piece of its one-line refusal.
# fmt: off
REFUSED = {
    frozenset({"W4P4", "decoder_expert_count=2"}): "--moe-expert-parallel-size 4 does not divide",
    frozenset({"upcycle_from=dense", "decoder_expert_count=2"}): "--moe-upcycle-from copies each dense FFN into",
    frozenset({"upcycle_from=dense", "router=sigmoid"}): "--moe-upcycle-from starts the router at zero",
    frozenset({"upcycle_from=dense", "router=cosine"}): "--moe-upcycle-from starts the router at zero",
    frozenset({"balance_scope=global-batch", "freeze=router"}): "--moe-balance-scope global-batch shapes the balance",
    frozenset({"upcycle_from=dense", "shared_expert_count=1"}): "--moe-upcycle-from starts the model as the dense",
}
# fmt: on


@dataclass(frozen=True)
class Cell:
    levels: Tuple[Level, ...]

    def level(self, factor: str) -> Level:
        return next(level for level in self.levels if level.factor == factor)

    @property
    def id(self) -> str:
        layout = [self.level(f).name for f in ("backend", "layout", "precision", "update_freq")]
        features = [level.name for level in self.levels if level.factor not in LAYOUT and level.name != "default"]
        return "-".join(layout) + "".join(f"+{name}" for name in features)

    @property
    def world(self) -> int:
        return self.level("layout").world

    @property
    def parallel(self) -> int:
        return self.level("layout").parallel

    @property
    def update_freq(self) -> int:
        return int(self.level("update_freq").flags[-1])

    def has(self, name: str) -> bool:
        return any(level.name == name for level in self.levels)

    def flags(self, dense_checkpoint: str = "", one_process: bool = False) -> List[str]:
        """The cell's command line; ``one_process``: its reference's, on fairseq's default backend, no layout."""
        levels = [lv for lv in self.levels if not (one_process and lv.factor in ("backend", "layout"))]
        words = [word for level in levels for word in level.flags]
        return [word.replace("{dense}", dense_checkpoint) for word in words]

    @property
    def refusal(self) -> Optional[str]:
        names = {level.name for level in self.levels}
        return next((line for pair, line in REFUSED.items() if pair <= names), None)

    def with_level(self, level: Level) -> "Cell":
        return Cell(tuple(level if lv.factor == level.factor else lv for lv in self.levels))

    @property
    def reference_key(self) -> Tuple[str, ...]:
        """What one process's step depends on: the features, the precision and the micro-batches."""
        return tuple(level.name for level in self.levels if level.factor not in ("backend", "layout"))


LAYOUT = ("backend", "layout", "precision", "update_freq")


def _refused(names) -> bool:
    return any(pair <= set(names) for pair in REFUSED)


def covering_cells(factor_list=None) -> List[Cell]:
    """Cells covering every pair of levels of two factors: the allowed pairs in cells the plugin runs, each
    refused pair in a cell of its own (every other factor at its default). Greedy and deterministic: each new
    cell starts from the first pair still uncovered, then takes, factor by factor (most levels first), the
    level that covers the most pairs still uncovered with the levels already chosen, refused pairs avoided."""
    factor_list = factor_list or factors()
    levels = [lv for _, lv in factor_list]
    pairs = {
        ((i, a), (j, b))
        for i, j in combinations(range(len(levels)), 2)
        for a in range(len(levels[i]))
        for b in range(len(levels[j]))
    }
    name = lambda i, a: levels[i][a].name  # noqa: E731
    refused = {p for p in pairs if _refused({name(*p[0]), name(*p[1])})}
    uncovered = pairs - refused
    order = sorted(range(len(levels)), key=lambda i: (-len(levels[i]), i))
    cells = []
    while uncovered:
        (i, a), (j, b) = min(uncovered)
        chosen = {i: a, j: b}
        for k in order:
            if k in chosen:
                continue
            best, best_gain = 0, -1
            for c in range(len(levels[k])):
                if _refused([name(m, x) for m, x in chosen.items()] + [name(k, c)]):
                    continue
                gain = sum((min((m, x), (k, c)), max((m, x), (k, c))) in uncovered for m, x in chosen.items())
                if gain > best_gain:
                    best, best_gain = c, gain
            chosen[k] = best
        cell = tuple(levels[k][chosen[k]] for k in range(len(levels)))
        uncovered -= {p for p in combinations(sorted(chosen.items()), 2)}
        cells.append(Cell(cell))
    for (i, a), (j, b) in sorted(refused):
        chosen = {k: 0 for k in range(len(levels))}
        chosen.update({i: a, j: b})
        cells.append(Cell(tuple(levels[k][chosen[k]] for k in range(len(levels)))))
    return cells


def pairs_covered(cells: List[Cell], factor_list=None) -> Dict[Tuple[str, str], List[str]]:
    """Every pair of levels of two factors, with the ids of the cells holding it."""
    factor_list = factor_list or factors()
    covered = {}
    for (_, first), (_, second) in combinations(factor_list, 2):
        for a in first:
            for b in second:
                holders = [c.id for c in cells if c.has(a.name) and c.has(b.name)]
                covered[(a.name, b.name)] = holders
    return covered
