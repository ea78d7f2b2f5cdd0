"""Which files ``import-fairseq-moe PREFIX`` reads: a plain branch set, or one FSDP training consolidated.

A moe/nllb-branch run with ``--ddp-backend fully_sharded --use-sharded-state`` saves, on every rank r,
``<P>-rank-<r>-shard<r>.pt`` (its experts, FSDP flat parameters) and ``<P>-shared-shard<r>.pt`` (its
slice of every other parameter, flattened), each with a ``shard_metadata`` entry. The branch's
``consolidate_fsdp_shards(P)`` (``fairseq/distributed/fully_sharded_data_parallel.py`` there; read in
two copies of the branch code, an nllb-based fork and a moe-branch copy, identical here) un-flattens
them with fairscale's ``FSDP.consolidate_shard_weights`` and writes ``<P>_consolidated-shared.pt`` (the
dense slices joined, under the module's own parameter names: fairscale's metadata holds the cleaned
paths, no ``_fsdp_wrapped_module``) and one ``<P>_consolidated-rank-<r>.pt`` per rank (that rank's
experts, numbered from 0 as in a plain set), each with the run's cfg, args, extra state and optimizer
history and no optimizer state. It returns (and prints) ``<P>_consolidated.pt``. So the consolidated
files are a plain set under the prefix ``<P>_consolidated``; this module lets the user pass that
prefix, the ``<P>_consolidated.pt`` the function printed, or the training prefix ``P`` itself.

The raw ``-shard`` files themselves are read by ``fsdp_shards.py`` when no plain or consolidated
set is under the prefix.
"""

import glob
import os
import re
from typing import Dict, Optional, Tuple

from ..errors import CheckpointSetError

CONSOLIDATED = "_consolidated"
FLAT = re.compile(r"(^|\.)(flat_param(_\d+)?|_fsdp_wrapped_module|_fpw_module)(\.|$)")


def _has_set(prefix: str) -> bool:
    return os.path.isfile(f"{prefix}-rank-0.pt") or os.path.isfile(f"{prefix}-shared.pt")


def _has_rank_files(prefix: str) -> bool:
    pattern = re.compile(re.escape(prefix) + r"-rank-\d+\.pt$")
    return any(pattern.match(p) for p in glob.glob(glob.escape(prefix) + "-rank-*.pt"))


def sharded_files(prefix: str):
    escaped = glob.escape(prefix)
    return sorted(glob.glob(escaped + "-shared-shard*.pt") + glob.glob(escaped + "-rank-*-shard*.pt"))


def resolve_prefix(prefix: str) -> Tuple[str, Optional[str]]:
    """(the prefix of the files to read, a NOTE line or None) for what the user passed."""
    if prefix.endswith(".pt") and not _has_set(prefix) and _has_set(prefix[:-3]):
        prefix = prefix[:-3]  # consolidate_fsdp_shards returns and prints "<P>_consolidated.pt"
    consolidated = prefix + CONSOLIDATED
    if prefix.endswith(CONSOLIDATED) or not (_has_rank_files(consolidated) or _has_set(consolidated)):
        return prefix, None
    if _has_rank_files(prefix) or os.path.isfile(f"{prefix}-shared.pt"):
        raise CheckpointSetError(
            f"{prefix}-*.pt and {consolidated}-*.pt are both here: a plain set and a consolidated FSDP one under "
            f"one name; pass the prefix of the one you mean ({prefix} or {consolidated}) (nothing was written)"
        )
    return consolidated, f"reading {consolidated}-*.pt, the files consolidate_fsdp_shards wrote from {prefix}'s shards"


def missing_rank_hint(prefix: str, rank: int) -> str:
    """What to add to "rank file r is missing" when the set is a consolidated one."""
    if not prefix.endswith(CONSOLIDATED):
        return ""
    trained = prefix[: -len(CONSOLIDATED)]
    shards = glob.glob(glob.escape(trained) + f"-rank-{rank}-shard*.pt")
    where = f" ({os.path.basename(shards[0])} is here)" if shards else ""
    return f"; consolidation stopped before it{where}: rerun the branch's consolidate_fsdp_shards on {trained}"


def refuse_flat(model: Dict, path: str) -> None:
    """A file still holding FSDP's flat parameters (a shard renamed, or consolidation skipped) is refused."""
    flat = next((k for k in model if isinstance(k, str) and FLAT.search(k)), None)
    if flat is not None:
        raise CheckpointSetError(
            f"{path} holds {flat}, an FSDP flat parameter: a shard that was not consolidated; run the branch's "
            f"consolidate_fsdp_shards on the -shard files and import the <prefix>_consolidated files (nothing was "
            f"written)"
        )
