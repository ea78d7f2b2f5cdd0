"""How the one-shot's fairseq runs are judged against each other (oneshot_fairseq.py, oneshot_ranks.py).

A loss that falls by 30% does not show a wrong gradient scale: Adam divides it away, so a gradient W times too
large (a sum over workers never averaged) trains on. Each run is therefore held to a reference run on the same
seed and batches, update by update over its first updates (before rounding makes runs drift apart), by its
logged loss and gradient norm: a two-rank run to the two-rank legacy_ddp run, a low-precision run to the fp32
run. Where runs may end apart (another precision over hundreds of updates), the final losses are held to the
spread of two fp32 runs that differ only in their seed. A run that stopped is a failure unless it said the
plugin's own one-line refusal, ``<prog>: error: rank r of W: <line>``.
"""

import math
import re

from oneshot_runs import by_update

FIRST = 20  # the updates compared one by one
# The precision of the compared runs: (relative loss, relative gradient norm) allowed at each of the first
# updates. The dry run measured at most 3e-4 / 2.6e-3 (two ranks against legacy_ddp, bf16) and 6e-3 / 2.1e-2
# (bf16 against fp32); a gradient twice too large doubles the norm.
# fmt: off
PER_UPDATE = {
    "fp32": (1e-3, 1e-2),
    "bf16": (2e-2, 1e-1),
    "fp16": (1e-2, 5e-2),
    "amp": (1e-2, 5e-2),
}
# fmt: on
SEED_SPREADS = 2  # a precision's final losses may differ from fp32's by twice the two fp32 seeds' spread ...
SPREAD_FLOOR = 0.01  # ... or 1%, where the two seeds happen to end close


def track(name, reference, precision, first=FIRST):
    """(ok, text): run ``name`` against ``reference``, update by update over the first ``first`` updates both
    logged, by loss and gradient norm within ``PER_UPDATE[precision]``."""
    got, want = by_update(name), by_update(reference)
    common = sorted(u for u in set(got) & set(want) if all(map(math.isfinite, (*got[u], *want[u]))))[:first]
    if not common:
        return False, f"no update to compare with {reference} ({len(got)} and {len(want)} logged)"
    loss_bound, gnorm_bound = PER_UPDATE[precision]
    worst_loss = max((abs(got[u][0] - want[u][0]) / abs(want[u][0]), u) for u in common)
    worst_gnorm = max((abs(got[u][1] - want[u][1]) / max(abs(want[u][1]), 1e-12), u) for u in common)
    ok = worst_loss[0] <= loss_bound and worst_gnorm[0] <= gnorm_bound
    text = (
        f"against {reference} over updates {common[0]}-{common[-1]}: loss within {worst_loss[0]:.2%} "
        f"(update {worst_loss[1]}, bound {loss_bound:.1%}), gradient norm within {worst_gnorm[0]:.2%} "
        f"(update {worst_gnorm[1]}: {got[worst_gnorm[1]][1]:.3f} vs {want[worst_gnorm[1]][1]:.3f}, "
        f"bound {gnorm_bound:.0%})"
    )
    return ok, text


def spread_bound(fp32, seed2):
    """How far a precision's final (train, valid) losses may be from fp32's: twice the fp32 seeds' spread."""
    spread = max(abs(seed2[0] - fp32[0]) / fp32[0], abs(seed2[1] - fp32[1]) / fp32[1])
    return max(SEED_SPREADS * spread, SPREAD_FLOOR), spread


def refusal(text):
    """The plugin's one-line refusal a two-rank run died of before training (``<prog>: error: rank r of W:
    <line>``, fairseq_integration/cli.py), or None: anything else that stopped a run is a failure."""
    if re.search(r"\| train_inner \|", text):
        return None
    said = [REFUSAL_LINE.match(line) for line in text.splitlines()]
    said = [m.group(1) for m in said if m]
    return said[-1] if said else None


REFUSAL_LINE = re.compile(r"^[\w.-]+: error: rank \d+ of \d+: (.+)$")
