"""``import-fairseq-moe``: a fairseq ``moe``/``nllb``-branch checkpoint set becomes this project's.

The branch's layout (its ``checkpoint_utils.py``): every rank r wrote ``<prefix>-rank-<r>.pt``
holding its experts, numbered from 0 in each file (``<side>.layers.<i>.moe_layer.experts.<j>.fc1|fc2
.weight|bias``), and the data-parallel master wrote ``<prefix>-shared.pt`` holding everything else,
the routers (``...moe_layer.gate.wg.weight``, ``[E, d]``) included. With E >= R rank files, rank r
holds experts ``r*E/R + j``; with E < R, rank r holds expert ``r % E`` (the others are replicas,
which must be identical).

Here each MoE layer's experts are stacked tensors (``<side>.layers.<i>.fc1.experts.batched_fc1_w``
``[E, hidden, d]`` etc., ``moe/experts.py``) beside the router ``fc1.router.wg.weight``. The import
streams: the shared file stays loaded until output rank 0 is written, then one source rank file at a
time is read and its experts go into the output file they belong to, which is written as soon as
all its experts are in. Peak memory is the shared file, one source rank file and one output file's
experts, not the model (benchmarks/import_memory.py measures it). Replicas are compared by sha256.

No optimizer state is carried over (the branch's is per expert module, and FSDP's flattened):
continued training starts a fresh optimizer, as after upcycling. Files are read through
``safe_load`` (the branch's pickles hold argparse Namespaces and numpy scalars, both allowed).
"""

import argparse
import copy
import glob
import hashlib
import math
import os
import re
import secrets
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .branch_options import branch_flags, model_options
from .errors import CheckpointSetError
from .manifest import describe_file, write_manifest
from .names import base_of, manifest_path, rank_file
from .rank_state import moe_metadata
from .safe_load import safe_load
from .staging import write_all_or_nothing

BRANCH_EXPERT = re.compile(r"^(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.moe_layer\.experts\.(?P<local>\d+)\."
                           r"(?P<tensor>fc1\.weight|fc1\.bias|fc2\.weight|fc2\.bias)$")
BRANCH_ROUTER = re.compile(r"^(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.moe_layer\.gate\.wg\.weight$")
OUR_EXPERT_TENSOR = {"fc1.weight": "fc1.experts.batched_fc1_w", "fc1.bias": "fc1.experts.batched_fc1_b",
                     "fc2.weight": "fc1.experts.batched_fc2_w", "fc2.bias": "fc1.experts.batched_fc2_b"}
OUR_ROUTER = "fc1.router.wg.weight"
RANK_FILE = re.compile(r"-rank-(\d+)\.pt$")


def branch_files(prefix: str) -> Tuple[str, List[str]]:
    """(``<prefix>-shared.pt``, ``[<prefix>-rank-0.pt, ...]``) after checking the ranks run 0..R-1."""
    shared = f"{prefix}-shared.pt"
    found = {}
    for path in glob.glob(glob.escape(prefix) + "-rank-*.pt"):
        match = RANK_FILE.search(path)
        if match and path == f"{prefix}-rank-{int(match.group(1))}.pt":  # not -rank-01.pt, -rank-0-shard0.pt
            found[int(match.group(1))] = path
    sharded = sorted(glob.glob(glob.escape(prefix) + "-shared-shard*.pt") + glob.glob(glob.escape(prefix) + "-rank-*-shard*.pt"))
    if not found and sharded:
        raise CheckpointSetError(
            f"{sharded[0]} is an FSDP-sharded branch file: consolidate the shards with the branch's "
            f"consolidate_fsdp_shards first and import its <prefix>_consolidated files (nothing was written)"
        )
    if not found:
        hint = (" (it holds config.json: a Hugging Face checkpoint; use import-hf)"
                if os.path.isfile(os.path.join(prefix, "config.json")) else "")
        raise CheckpointSetError(
            f"no {prefix}-rank-0.pt: import-fairseq-moe reads <prefix>-shared.pt and <prefix>-rank-N.pt files written "
            f"by the moe/nllb branch{hint}; pass the prefix of those files (nothing was written)"
        )
    ranks = sorted(found)
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        raise CheckpointSetError(
            f"{prefix}-rank-{missing[0]}.pt is missing (found ranks {_ranges(ranks)}): every rank file of the run is "
            f"needed; copy it beside the others (nothing was written)"
        )
    if not os.path.isfile(shared):
        raise CheckpointSetError(
            f"{shared} is missing: the branch's data-parallel master wrote every parameter that is not an expert "
            f"there; copy it beside the rank files (nothing was written)"
        )
    return shared, [found[r] for r in ranks]


def _ranges(ranks: List[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def _digest(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data if flat.numel() else b"").hexdigest()


class BranchSet:
    """What the shared file and rank 0 say about the set: options, MoE layers, expert count, shapes."""

    def __init__(self, prefix: str, load: Callable[[str], Dict] = safe_load):
        self.prefix = prefix
        self.load = load
        self.shared_path, self.rank_paths = branch_files(prefix)
        self.shared = self._load(self.shared_path)
        first = self._load(self.rank_paths[0])
        self.options = model_options(first, self.rank_paths[0])
        self.head = {k: first.get(k) for k in ("cfg", "args", "optimizer_history", "extra_state", "task_state")}
        self.routers = {m["layer"]: self.shared["model"][k].shape for k in self.shared["model"]
                        if (m := BRANCH_ROUTER.match(k))}
        if not self.routers:
            raise CheckpointSetError(
                f"{self.shared_path} holds no MoE router (<side>.layers.N.moe_layer.gate.wg.weight): not a moe/nllb-"
                f"branch checkpoint (this project's own sets are used as they are; a Hugging Face NllbMoe directory "
                f"goes through import-hf) (nothing was written)"
            )
        counts = {shape[0] for shape in self.routers.values()}
        self.experts = int(next(iter(counts)))
        declared = int(getattr(self.options, "moe_expert_count", 0) or 0)
        if len(counts) > 1 or declared != self.experts:
            raise CheckpointSetError(
                f"{self.shared_path}: the routers' expert counts {sorted(counts)} disagree with --moe-expert-count "
                f"{declared} in {self.rank_paths[0]}: files from different runs (nothing was written)"
            )
        world = len(self.rank_paths)
        declared_world = _declared_world(first)
        if declared_world is not None and declared_world != world:
            if world < declared_world:
                raise CheckpointSetError(
                    f"{prefix}-rank-{world}.pt is missing: the run had {declared_world} workers "
                    f"(distributed_world_size), {world} rank files are here; copy the others beside them (nothing "
                    f"was written)")
            raise CheckpointSetError(
                f"{prefix}-rank-{declared_world}.pt is an extra rank file from another run: the run had "
                f"{declared_world} workers (distributed_world_size); move -rank-{declared_world}.pt ... "
                f"-rank-{world - 1}.pt away (nothing was written)")
        self.world = world
        self.local = max(1, self.experts // world)
        layers = {side: int(getattr(self.options, f"{side}_layers", 0) or 0) for side in ("encoder", "decoder")}
        self.flags, self.notes = branch_flags(self.options, self.rank_paths[0], layers)
        self.first_state = first  # rank 0's experts, consumed by the first pass of ``rank_experts``
        self.num_updates = int(((first.get("optimizer_history") or [{}])[-1] or {}).get("num_updates", 0) or 0)

    def _load(self, path: str) -> Dict:
        state = self.load(path)
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise CheckpointSetError(f"{path} holds no model state: not a fairseq checkpoint file (nothing was written)")
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
    section = cfg.get("distributed_training") if isinstance(cfg, dict) else None
    value = (section.get("distributed_world_size") if isinstance(section, dict)
             else getattr(section, "distributed_world_size", None) if section is not None
             else getattr(state.get("args"), "distributed_world_size", None))
    return int(value) if isinstance(value, int) and value > 0 else None


class _Shards:
    """The output: shard s of P holds global experts ``s*E/P ...``; written as soon as complete."""

    def __init__(self, branch: BranchSet, shards: int):
        self.branch, self.shards, self.per_shard = branch, shards, branch.experts // shards
        # shard -> (layer, tensor name) -> (the stacked output tensor being filled, the ids copied in)
        self.pending: Dict[int, Dict[Tuple[str, str], Tuple[torch.Tensor, set]]] = {}
        self.digests: Dict[Tuple[str, str, int], Tuple[str, str]] = {}  # -> (sha256, file it came from)
        self.shapes: Dict[Tuple[str, str], Tuple[tuple, str]] = {}
        self.keys: Optional[List[Tuple[str, str]]] = None

    def add(self, path: str, experts: Dict[Tuple[str, str], Dict[int, torch.Tensor]]) -> List[int]:
        """Take one rank file's experts; return the shards now complete."""
        if self.keys is None:
            self.keys = sorted(experts)
            missing = sorted(set(self.branch.routers) - {layer for layer, _ in self.keys})
            if missing:
                raise CheckpointSetError(f"{path} holds no experts of {missing[0]}, which has a router in "
                                         f"{self.branch.shared_path}: a file from another run (nothing was written)")
        if sorted(experts) != self.keys:
            odd = sorted(set(experts) ^ set(self.keys))[0]
            raise CheckpointSetError(f"{path} differs from {self.branch.rank_paths[0]} in which expert tensors it "
                                     f"holds ({'.'.join(odd)}): files from different runs (nothing was written)")
        touched = set()
        for key, by_id in experts.items():
            for gid, tensor in by_id.items():
                self._check_shape(key, tensor, path)
                digest = _digest(tensor)
                seen = self.digests.get((*key, gid))
                if seen is not None:
                    if seen[0] != digest:
                        raise CheckpointSetError(
                            f"{path} and {seen[1]} hold different copies of expert {gid} ({key[0]}.moe_layer.experts."
                            f"*.{key[1]}): replicas must be identical, the run diverged; import a checkpoint saved "
                            f"before it did (nothing was written)")
                    continue
                self.digests[(*key, gid)] = (digest, path)
                shard = gid // self.per_shard
                # Copied into the output at once (not kept and stacked later): the source file's memory is
                # reused for the next one, and the output is never held twice.
                stacked, filled = self.pending.setdefault(shard, {}).setdefault(
                    key, (tensor.new_empty((self.per_shard, *tensor.shape)), set()))
                stacked[gid - shard * self.per_shard].copy_(tensor)
                filled.add(gid)
                touched.add(shard)
        return sorted(s for s in touched
                      if all(len(self.pending[s].get(k, (None, ()))[1]) == self.per_shard for k in self.keys))

    def _check_shape(self, key, tensor, path):
        first = self.shapes.setdefault(key, (tuple(tensor.shape), path))
        router = self.branch.routers[key[0]]
        model_dim = {"fc1.weight": 1, "fc2.weight": 0, "fc2.bias": 0}.get(key[1])
        if tuple(tensor.shape) != first[0] or (model_dim is not None and tensor.shape[model_dim] != router[1]):
            raise CheckpointSetError(
                f"{path}: {key[0]}.moe_layer.experts.*.{key[1]} has shape {list(tensor.shape)}, but "
                f"{first[1]} has {list(first[0])} and the router expects model dim {router[1]}: files from "
                f"different runs (nothing was written)")

    def take(self, shard: int) -> Dict[str, torch.Tensor]:
        """Shard ``shard``'s experts as this project's stacked tensors (released from ``pending``)."""
        parts = self.pending.pop(shard)
        return {f"{layer}.{OUR_EXPERT_TENSOR[name]}": parts[(layer, name)][0] for layer, name in self.keys}


def expert_ffn_dims(branch: BranchSet, keys: List[Tuple[str, str]], shapes) -> Dict[str, int]:
    return {layer.split(".")[0]: shapes[(layer, "fc1.weight")][0][0] for layer, name in keys if name == "fc1.weight"}


def imported_cfg(branch: BranchSet, flags: Dict) -> Tuple[Optional[Dict], Optional[argparse.Namespace]]:
    """(cfg, args) for this project's ``moe_transformer`` with ``flags``, from the branch file's."""
    options = argparse.Namespace(**{**vars(branch.options), **flags, "arch": "moe_transformer",
                                    "_name": "moe_transformer"})
    cfg = branch.head["cfg"]
    if not isinstance(cfg, dict):
        return None, options
    cfg = copy.copy(cfg)
    cfg["model"] = options if isinstance(cfg.get("model"), argparse.Namespace) else vars(options)
    criterion = cfg.get("criterion")
    if isinstance(criterion, dict):  # the branch's criteria carry options fairseq 0.12 does not know
        cfg["criterion"] = {k: v for k, v in criterion.items() if k in CRITERION_KEYS}
    return cfg, None


CRITERION_KEYS = ("_name", "label_smoothing", "report_accuracy", "ignore_prefix_size", "sentence_avg", "moe_gate_loss_wt")


def import_branch_set(prefix: str, output: str, workers: int, report: Callable[[str], None] = print) -> str:
    """Import the set at ``prefix`` as ``output`` for ``workers`` workers; returns what was written."""
    if workers < 1:
        raise CheckpointSetError(f"--world-size must be a positive number of workers, got {workers}")
    branch = BranchSet(prefix)
    shards = math.gcd(workers, branch.experts)
    report(f"found {prefix}: {branch.world} rank files + shared, arch {getattr(branch.options, 'arch', '?')}, "
           f"{branch.experts} experts ({'%d per rank file' % branch.local if branch.experts >= branch.world else '%d replicas each' % (branch.world // branch.experts)}), "
           f"MoE layers {', '.join(sorted(branch.routers))}, update {branch.num_updates}")
    set_id = secrets.token_hex(8)
    base = base_of(output)
    single = workers == 1

    def write(staging_dir):
        out = _Shards(branch, shards)
        names, files, parameters, head = [], [], 0, None
        for rank, path, experts in branch.rank_experts():
            complete = out.add(path, experts)
            experts.clear()  # the pieces live on in ``out`` only, so stacking them can release them
            for shard in complete:
                model = out.take(shard)
                if shard == 0:
                    model = {**shared_model(branch), **model}
                    flags = dict(branch.flags)
                    dims = expert_ffn_dims(branch, out.keys, out.shapes)
                    if any(dims[side] != getattr(branch.options, f"{side}_ffn_embed_dim", dims[side]) for side in dims):
                        flags["moe_expert_ffn_dim"] = max(dims.values())
                    head = imported_cfg(branch, flags)
                    branch.shared = None  # rank 0 is written: the shared state is not needed any more
                parameters += sum(t.numel() for t in model.values())
                state = _state(branch, head, model, shard, shards, set_id, single)
                name = os.path.basename(output if single else rank_file(base, shard, shards))
                torch.save(state, os.path.join(staging_dir, name))
                del state, model
                names.append(name)
                files.append(dict(describe_file(os.path.join(staging_dir, name)), rank=shard))
        report(f"parameters: {parameters}")
        if single:
            return names
        written = write_manifest(os.path.join(staging_dir, os.path.basename(base)), shards, branch.num_updates, files,
                                 {f"{layer}.{OUR_EXPERT_TENSOR[name]}": branch.experts for layer, name in out.keys},
                                 set_id, workers=workers)
        return names + [os.path.basename(written)]

    what = output if single else f"the {shards}-file set {manifest_path(base)}"
    for line in branch.notes:
        report(f"NOTE {line}")
    report("flags: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(branch.flags.items())))
    write_all_or_nothing(os.path.dirname(output), what, write)
    report(f"wrote {output if single else manifest_path(base)}")
    return output if single else manifest_path(base)


def shared_model(branch: BranchSet) -> Dict[str, torch.Tensor]:
    model = {}
    for key, tensor in branch.shared["model"].items():
        router = BRANCH_ROUTER.match(key)
        if router:
            model[f"{router['layer']}.{OUR_ROUTER}"] = tensor
        elif ".moe_layer." in key:
            raise CheckpointSetError(f"{branch.shared_path} holds {key}: an MoE layer part with no counterpart here "
                                     f"(nothing was written)")
        else:
            model[key] = tensor
    return model


def _state(branch: BranchSet, head, model, shard, shards, set_id, single) -> Dict:
    cfg, args = head
    history = branch.head["optimizer_history"] or [{}]
    entry = {k: v for k, v in (history[-1] or {}).items() if k != "optimizer"}
    entry.setdefault("optimizer_name", "none")
    entry.setdefault("lr_scheduler_state", {"best": None})
    expert_keys = sorted(k for k in model if ".fc1.experts." in k)
    meta = moe_metadata([], expert_keys, world_size=1 if single else shards, rank=shard,
                        num_updates=branch.num_updates, set_id=None if single else set_id,
                        experts_per_worker=branch.experts // shards)
    meta["imported_from"] = branch.prefix
    return {"args": args, "cfg": cfg, "model": model, "criterion": {}, "optimizer_history": [entry],
            "task_state": branch.head.get("task_state") or {}, "extra_state": branch.head.get("extra_state") or {},
            "moe": meta}
