"""A fairseq ``moe``/``nllb``-branch checkpoint set, read one file at a time.

The branch's layout (its ``checkpoint_utils.py``): every rank r wrote ``<prefix>-rank-<r>.pt``
holding its experts, numbered from 0 in each file (``<side>.layers.<i>.moe_layer.experts.<j>.fc1|fc2
.weight|bias``), and the data-parallel master wrote ``<prefix>-shared.pt`` holding everything else,
the routers (``...moe_layer.gate.wg.weight``, ``[E, d]``) included. With E >= R rank files, rank r
holds experts ``r*E/R + j``; with E < R, rank r holds expert ``r % E`` (the others are replicas,
which must be identical: compared by sha256; a run's first E rank files alone carry every expert and are
imported with a NOTE). Files are read by ``one_read.load_skipping``: once, with the restricted types of
``safe_load`` (the branch's pickles hold argparse Namespaces and numpy scalars, both allowed), each
tensor's CRC-32 checked as it is read, and ``last_optimizer_state`` never read. ``importer.py`` writes the set.
"""

import glob
import hashlib
import os
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...common.config_value import config_value
from ...options import moe_options
from ..errors import CheckpointSetError
from ..one_read import load_skipping
from .consolidated import missing_rank_hint, refuse_flat, resolve_prefix, sharded_files
from .fsdp_shards import FsdpShards
from .options import branch_flags, is_language_model, model_options
from .same_run import SameRun

BRANCH_EXPERT = re.compile(
    r"^(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.moe_layer\.experts\.(?P<local>\d+)\."
    r"(?P<tensor>fc1\.weight|fc1\.bias|fc2\.weight|fc2\.bias)$"
)
BRANCH_ROUTER = re.compile(r"^(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.moe_layer\.gate\.wg\.weight$")
RANK_FILE = re.compile(r"-rank-(\d+)\.pt$")


def branch_files(prefix: str) -> Tuple[str, List[str]]:
    """(``<prefix>-shared.pt``, ``[<prefix>-rank-0.pt, ...]``) after checking the ranks run 0..R-1."""
    shared = f"{prefix}-shared.pt"
    found = _plain_rank_files(prefix)
    if not found:
        hint = (
            " (it holds config.json: a Hugging Face checkpoint; use import-hf)"
            if os.path.isfile(os.path.join(prefix, "config.json"))
            else ""
        )
        raise CheckpointSetError(
            f"no {prefix}-rank-0.pt: import-fairseq-moe reads <prefix>-shared.pt and <prefix>-rank-N.pt files written "
            f"by the moe/nllb branch{hint}; pass the prefix of those files (nothing was written)"
        )
    ranks = sorted(found)
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        raise CheckpointSetError(
            f"{prefix}-rank-{missing[0]}.pt is missing (found ranks {_ranges(ranks)}): every rank file of the run is "
            f"needed; copy it beside the others{missing_rank_hint(prefix, missing[0])} (nothing was written)"
        )
    if not os.path.isfile(shared):
        raise CheckpointSetError(
            f"{shared} is missing: the branch's data-parallel master wrote every parameter that is not an expert "
            f"there; copy it beside the rank files (nothing was written)"
        )
    return shared, [found[r] for r in ranks]


def _plain_rank_files(prefix: str) -> Dict[int, str]:
    found = {}
    for path in glob.glob(glob.escape(prefix) + "-rank-*.pt"):
        match = RANK_FILE.search(path)
        if match and path == f"{prefix}-rank-{int(match.group(1))}.pt":  # not -rank-01.pt, -rank-0-shard0.pt
            found[int(match.group(1))] = path
    return found


def _ranges(ranks: List[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def digest_of(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data if flat.numel() else b"").hexdigest()


class BranchSet:
    """What the shared file and rank 0 say about the set: options, MoE layers, expert count, shapes."""

    def __init__(
        self,
        prefix: str,
        load: Callable[[str], Dict] = load_skipping,
        on_files: Optional[Callable[[List[str]], None]] = None,
    ):
        """``load`` reads one file (default: in one read, without its optimizer state); ``on_files`` hears
        the list of files the set will read before the first is read."""
        prefix, consolidated = resolve_prefix(prefix)
        self.prefix = prefix
        sharded = [] if _plain_rank_files(prefix) else sharded_files(prefix)
        shards = FsdpShards(prefix, sharded) if sharded else None  # the raw -shard files of an FSDP run
        self.load = shards.load if shards is not None else load
        self.shared_path, self.rank_paths = (shards.shared_path, shards.rank_paths) if shards else branch_files(prefix)
        if on_files is not None:
            on_files([*(shards.shared_files if shards else [self.shared_path]), *self.rank_paths])
        self.shared = self._load(self.shared_path)
        first = self._load(self.rank_paths[0])
        self.same_run = SameRun(first, self.rank_paths[0])  # each file of the save checked against rank 0's
        self.same_run.check(self.shared, self.shared_path)
        self.options = model_options(first, self.rank_paths[0])
        self.head = {k: first.get(k) for k in ("cfg", "args", "optimizer_history", "extra_state", "task_state")}
        self.routers = {
            m["layer"]: self.shared["model"][k].shape for k in self.shared["model"] if (m := BRANCH_ROUTER.match(k))
        }
        if not self.routers:
            raise CheckpointSetError(
                f"{self.shared_path} holds no MoE router (<side>.layers.N.moe_layer.gate.wg.weight): not a moe/nllb-"
                f"branch checkpoint (this project's own sets are used as they are; a Hugging Face NllbMoe directory "
                f"goes through import-hf) (nothing was written)"
            )
        counts = {shape[0] for shape in self.routers.values()}
        self.experts = int(next(iter(counts)))
        declared = int(moe_options(self.options, as_saved=True).moe_expert_count or 0)
        if len(counts) > 1 or declared != self.experts:
            raise CheckpointSetError(
                f"{self.shared_path}: the routers' expert counts {sorted(counts)} disagree with --moe-expert-count "
                f"{declared} in {self.rank_paths[0]}: files from different runs (nothing was written)"
            )
        world = len(self.rank_paths)
        declared_world = _declared_world(first)
        replicas_left_out = None
        if declared_world is not None and declared_world != world:
            if self.experts <= world < declared_world and declared_world % self.experts == 0:
                # A run with more workers than experts: rank r held expert r % E, so ranks 0..E-1 hold every
                # expert and the others replicas (NLLB-200 MoE: 128 experts, 256 rank files).
                replicas_left_out = (
                    f"{world} of the run's {declared_world} rank files are here (distributed_world_size "
                    f"{declared_world}, {self.experts} experts: rank r held expert r % {self.experts}); ranks "
                    f"{world}..{declared_world - 1} hold replicas only, so the first {self.experts} carry every "
                    f"expert; replicas are compared where present"
                )
            elif world < declared_world:
                raise CheckpointSetError(
                    f"{prefix}-rank-{world}.pt is missing: the run had {declared_world} workers "
                    f"(distributed_world_size), {world} rank files are here; copy the others beside them"
                    f"{missing_rank_hint(prefix, world)} (nothing was written)"
                )
            else:
                raise CheckpointSetError(
                    f"{prefix}-rank-{declared_world}.pt is an extra rank file from another run: the run had "
                    f"{declared_world} workers (distributed_world_size); move -rank-{declared_world}.pt ... "
                    f"-rank-{world - 1}.pt away (nothing was written)"
                )
        self.world = world
        self.local = max(1, self.experts // world)
        # A moe_lm set (transformer_lm) is decoder-only: its options hold no encoder to place MoE layers in.
        self.language_model = is_language_model(self.options)
        sides = ("decoder",) if self.language_model else ("encoder", "decoder")
        layers = {side: int(getattr(self.options, f"{side}_layers", 0) or 0) for side in sides}
        self.flags, self.notes = branch_flags(self.options, self.rank_paths[0], layers)
        self.notes[:0] = [consolidated] if consolidated else [shards.note()] if shards else []
        self.notes[:0] = [replicas_left_out] if replicas_left_out else []
        self.first_state = first  # rank 0's experts, consumed by the first pass of ``rank_experts``
        self.num_updates = int(((first.get("optimizer_history") or [{}])[-1] or {}).get("num_updates", 0) or 0)

    def _load(self, path: str) -> Dict:
        state = self.load(path)
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise CheckpointSetError(
                f"{path} holds no model state: not a fairseq checkpoint file (nothing was written)"
            )
        refuse_flat(state["model"], path)
        return state

    def source_of(self, rank: int) -> List[int]:
        """The global expert ids rank ``rank``'s local experts 0, 1, ... are."""
        if self.experts >= self.world:
            return [rank * self.local + j for j in range(self.local)]
        return [rank % self.experts]

    def rank_experts(self):
        """Yield (rank, {(layer, tensor): {global id: tensor}}) for each rank file, one loaded at a time."""
        for rank, path in enumerate(self.rank_paths):
            state = self.first_state if rank == 0 else self._load(path)
            self.same_run.check(state, path)
            self.first_state = None
            ids = self.source_of(rank)
            out: Dict[Tuple[str, str], Dict[int, torch.Tensor]] = {}
            for key, tensor in state["model"].items():
                match = BRANCH_EXPERT.match(key)
                if not match:
                    raise CheckpointSetError(
                        f"{path} holds {key}, which is not a branch expert parameter (<side>.layers.N.moe_layer."
                        f"experts.J.fc1|fc2.weight|bias): another model's file (nothing was written)"
                    )
                local = int(match["local"])
                if match["layer"] not in self.routers or local >= len(ids):
                    raise CheckpointSetError(
                        f"{path} holds {key}, but the set has {len(ids)} expert(s) per rank file and no router for "
                        f"{match['layer']}: a file from another run (nothing was written)"
                    )
                out.setdefault((match["layer"], match["tensor"]), {})[ids[local]] = tensor
            del state
            yield rank, path, out


def _declared_world(state: Dict) -> Optional[int]:
    cfg = state.get("cfg")
    section = config_value(cfg, "distributed_training") if isinstance(cfg, dict) else None
    value = config_value(section if section is not None else state.get("args"), "distributed_world_size")
    return int(value) if isinstance(value, int) and value > 0 else None
