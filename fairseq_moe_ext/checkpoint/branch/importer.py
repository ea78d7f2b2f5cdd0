"""``import-fairseq-moe``: a fairseq ``moe``/``nllb``-branch checkpoint set becomes this project's.

The branch's layout and how it is read: ``reader.py``.

Here each MoE layer's experts are stacked tensors (``<side>.layers.<i>.fc1.experts.batched_fc1_w``
``[E, hidden, d]`` etc., ``moe/experts.py``) beside the router ``fc1.router.wg.weight``. The import
streams, the reader ``BranchShards`` into the set writer (set_writer.py): the shared file stays loaded
until output rank 0 is written, then one source rank file at a time is read and its experts go into the
output file they belong to, which is yielded and written as soon as all its experts are in. Each file is
read once (``one_read.py``: no CRC pass before the load; every tensor's CRC-32 is checked as it is read)
and its ``last_optimizer_state`` never: peak memory is the
shared file's model, one source rank file's model and one output file, not the model and not the
optimizer state (benchmarks/import_memory.py measures it). Replicas are compared by sha256. On a
terminal a progress bar shows the bytes done, the rate and the time left.

No optimizer state is carried over (the branch's is per expert module, and FSDP's flattened):
continued training starts a fresh optimizer, as after upcycling.
"""

import argparse
import copy
import os
from typing import Callable, Dict, List, Optional, TextIO, Tuple

import torch

from ...common.config_value import config_value
from ...moe.expert_layout import default_expert_parallel_size
from ..errors import CheckpointSetError
from ..names import base_of
from ..one_read import load_skipping
from ..progress import Progress
from ..rank_state import moe_metadata
from ..set_writer import write_shards
from .reader import BRANCH_ROUTER, BranchSet, digest_of
from .vocab import check_vocabulary, read_languages

# fmt: off
OUR_EXPERT_TENSOR = {"fc1.weight": "fc1.experts.batched_fc1_w", "fc1.bias": "fc1.experts.batched_fc1_b",
                     "fc2.weight": "fc1.experts.batched_fc2_w", "fc2.bias": "fc1.experts.batched_fc2_b"}
# fmt: on
OUR_ROUTER = "fc1.router.wg.weight"


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
                raise CheckpointSetError(
                    f"{path} holds no experts of {missing[0]}, which has a router in "
                    f"{self.branch.shared_path}: a file from another run (nothing was written)"
                )
        if sorted(experts) != self.keys:
            odd = sorted(set(experts) ^ set(self.keys))[0]
            raise CheckpointSetError(
                f"{path} differs from {self.branch.rank_paths[0]} in which expert tensors it "
                f"holds ({'.'.join(odd)}): files from different runs (nothing was written)"
            )
        touched = set()
        for key, by_id in experts.items():
            for gid, tensor in by_id.items():
                self._check_shape(key, tensor, path)
                digest = digest_of(tensor)
                seen = self.digests.get((*key, gid))
                if seen is not None:
                    if seen[0] != digest:
                        raise CheckpointSetError(
                            f"{path} and {seen[1]} hold different copies of expert {gid} ({key[0]}.moe_layer.experts."
                            f"*.{key[1]}): replicas must be identical, the run diverged; import a checkpoint saved "
                            f"before it did (nothing was written)"
                        )
                    continue
                self.digests[(*key, gid)] = (digest, path)
                shard = gid // self.per_shard
                # Copied into the output at once (not kept and stacked later): the source file's memory is
                # reused for the next one, and the output is never held twice.
                stacked, filled = self.pending.setdefault(shard, {}).setdefault(
                    key, (tensor.new_empty((self.per_shard, *tensor.shape)), set())
                )
                stacked[gid - shard * self.per_shard].copy_(tensor)
                filled.add(gid)
                touched.add(shard)
        return sorted(
            s for s in touched if all(len(self.pending[s].get(k, (None, ()))[1]) == self.per_shard for k in self.keys)
        )

    def _check_shape(self, key, tensor, path):
        first = self.shapes.setdefault(key, (tuple(tensor.shape), path))
        router = self.branch.routers[key[0]]
        model_dim = {"fc1.weight": 1, "fc2.weight": 0, "fc2.bias": 0}.get(key[1])
        if tuple(tensor.shape) != first[0] or (model_dim is not None and tensor.shape[model_dim] != router[1]):
            raise CheckpointSetError(
                f"{path}: {key[0]}.moe_layer.experts.*.{key[1]} has shape {list(tensor.shape)}, but "
                f"{first[1]} has {list(first[0])} and the router expects model dim {router[1]}: files from "
                f"different runs (nothing was written)"
            )

    def take(self, shard: int) -> Dict[str, torch.Tensor]:
        """Shard ``shard``'s experts as this project's stacked tensors (released from ``pending``)."""
        parts = self.pending.pop(shard)
        return {f"{layer}.{OUR_EXPERT_TENSOR[name]}": parts[(layer, name)][0] for layer, name in self.keys}


def expert_ffn_dims(branch: BranchSet, keys: List[Tuple[str, str]], shapes) -> Dict[str, int]:
    return {layer.split(".")[0]: shapes[(layer, "fc1.weight")][0][0] for layer, name in keys if name == "fc1.weight"}


def imported_cfg(branch: BranchSet, flags: Dict) -> Tuple[Optional[Dict], Optional[argparse.Namespace]]:
    """(cfg, args) for this project's ``moe_transformer`` (``moe_transformer_lm`` for a moe_lm set) with
    ``flags``, from the branch file's. The branch's other options keep their names and meanings; fairseq
    drops those the model's config does not know when it loads the checkpoint."""
    arch = "moe_transformer_lm" if branch.language_model else "moe_transformer"
    options = argparse.Namespace(**{**vars(branch.options), **flags, "arch": arch, "_name": arch})
    cfg = branch.head["cfg"]
    if not isinstance(cfg, dict):
        return None, options
    cfg = copy.copy(cfg)
    cfg["model"] = options if isinstance(cfg.get("model"), argparse.Namespace) else vars(options)
    criterion = cfg.get("criterion")
    if isinstance(criterion, dict):  # the branch's criteria carry options fairseq 0.12 does not know
        cfg["criterion"] = {k: v for k, v in criterion.items() if k in CRITERION_KEYS}
    return cfg, None


# The criterion options kept: fairseq 0.12's and those of this project's MoE criterions that the branch's have
# under the same name and meaning (NLLB-200 MoE: the gate losses summed over layers, not averaged).
# fmt: off
CRITERION_KEYS = ("_name", "label_smoothing", "report_accuracy", "ignore_prefix_size", "sentence_avg",
                  "moe_gate_loss_wt", "moe_gate_loss_combine_method")
# fmt: on


def import_branch_set(
    prefix: str,
    output: str,
    workers: int,
    report: Callable[[str], None] = print,
    dictionary: Optional[str] = None,
    langs: Optional[str] = None,
    progress_stream: Optional[TextIO] = None,
) -> str:
    """Import the set at ``prefix`` as ``output`` for ``workers`` workers; returns what was written.
    With ``dictionary``, first check it (and ``langs``) against the embedding (``vocab.py``). A progress
    bar goes to ``progress_stream`` (default stderr) when it is a terminal."""
    if workers < 1:
        raise CheckpointSetError(f"--world-size must be a positive number of workers, got {workers}")
    if langs is not None:
        read_languages(langs)  # an empty or duplicated list is refused before any file is read
    progress = Progress(f"reading {os.path.basename(prefix)}", stream=progress_stream)
    sizes = {}

    def load(path):
        state = load_skipping(path, on_read=progress.read)
        progress.file_done(sizes.get(path, 0))
        return state

    def files(paths):
        sizes.update((p, os.path.getsize(p)) for p in paths)
        progress.set_total(sum(sizes.values()))

    try:
        branch = BranchSet(prefix, load=load, on_files=files)
        return _import(branch, output, workers, report, dictionary, langs)
    finally:
        progress.close()


def _import(branch: BranchSet, output: str, workers: int, report, dictionary, langs) -> str:
    if dictionary is not None:
        branch.notes.extend(
            check_vocabulary(
                branch.shared["model"],
                (branch.head.get("cfg") or {}).get("task") or branch.head.get("args"),
                dictionary,
                langs,
                branch.shared_path,
            )
        )
    shards = default_expert_parallel_size(workers, branch.experts)
    held = (
        f"{branch.local} per rank file"
        if branch.experts >= branch.world
        else f"{branch.world // branch.experts} replicas each"
    )
    report(
        f"found {branch.prefix}: {branch.world} rank files + shared, arch {config_value(branch.options, 'arch', '?')}, "
        f"{branch.experts} experts ({held}), "
        f"MoE layers {', '.join(sorted(branch.routers))}, update {branch.num_updates}"
    )
    for line in branch.notes:
        report(f"NOTE {line}")
    report("flags: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(branch.flags.items())))
    single = workers == 1
    reader = BranchShards(branch, shards, single, report)
    written = write_shards(reader, base_of(output), single=output if single else None, workers=workers)
    report(f"wrote {written}")
    return written


class BranchShards:
    """The reader of a branch set (set_writer.py): one source rank file at a time is read (``BranchSet``) and
    its experts go into the output rank files they belong to, each yielded as soon as all its experts are in
    (rank 0 with the shared state, which is let go then). ``report`` gets the parameter count at the end."""

    def __init__(self, branch: BranchSet, shards: int, single: bool, report):
        self.branch, self.shards, self.single, self.report = branch, shards, single, report
        self.num_updates = branch.num_updates
        self.experts: Dict[str, int] = {}  # known once the last rank file is read

    def pieces(self, set_id: Optional[str]):
        branch = self.branch
        out = _Shards(branch, self.shards)
        parameters, head = 0, None
        for rank, path, experts in branch.rank_experts():
            complete = out.add(path, experts)
            experts.clear()  # the pieces live on in ``out`` only, so stacking them can release them
            for shard in complete:
                model = out.take(shard)
                if shard == 0:
                    model = {**shared_model(branch), **model}
                    flags = dict(branch.flags)
                    dims = expert_ffn_dims(branch, out.keys, out.shapes)
                    if any(
                        dims[side] != config_value(branch.options, f"{side}_ffn_embed_dim", dims[side]) for side in dims
                    ):
                        flags["moe_expert_ffn_dim"] = max(dims.values())
                    head = imported_cfg(branch, flags)
                    branch.shared = None  # rank 0 is written: the shared state is not needed any more
                parameters += sum(t.numel() for t in model.values())
                state = _state(branch, head, model, shard, self.shards, set_id, self.single)
                yield shard, state
                del state, model
        self.report(f"parameters: {parameters}")
        self.experts = {f"{layer}.{OUR_EXPERT_TENSOR[name]}": branch.experts for layer, name in out.keys}


def shared_model(branch: BranchSet) -> Dict[str, torch.Tensor]:
    model = {}
    for key, tensor in branch.shared["model"].items():
        router = BRANCH_ROUTER.match(key)
        if router:
            model[f"{router['layer']}.{OUR_ROUTER}"] = tensor
        elif ".moe_layer." in key:
            raise CheckpointSetError(
                f"{branch.shared_path} holds {key}: an MoE layer part with no counterpart here (nothing was written)"
            )
        else:
            model[key] = tensor
    # The released NLLB shared file holds the tied embedding three times (FSDP saves each name's own copy):
    # equal copies are stored once, as torch.save stores a tensor shared by several names; fairseq ties them.
    embedding = model.get("encoder.embed_tokens.weight")
    for key in TIED_COPIES:
        copy_ = model.get(key)
        if embedding is not None and copy_ is not None and copy_ is not embedding:
            if copy_.shape == embedding.shape and copy_.dtype == embedding.dtype and torch.equal(copy_, embedding):
                model[key] = embedding
    return model


TIED_COPIES = ("decoder.embed_tokens.weight", "decoder.output_projection.weight")


def _state(branch: BranchSet, head, model, shard, shards, set_id, single) -> Dict:
    cfg, args = head
    history = branch.head["optimizer_history"] or [{}]
    entry = {k: v for k, v in (history[-1] or {}).items() if k != "optimizer"}
    entry.setdefault("optimizer_name", "none")
    entry.setdefault("lr_scheduler_state", {"best": None})
    expert_keys = sorted(k for k in model if ".fc1.experts." in k)
    meta = moe_metadata(
        [],
        expert_keys,
        world_size=1 if single else shards,
        rank=shard,
        num_updates=branch.num_updates,
        set_id=None if single else set_id,
        experts_per_worker=branch.experts // shards,
    )
    meta["imported_from"] = branch.prefix
    return {
        "args": args,
        "cfg": cfg,
        "model": model,
        "criterion": {},
        "optimizer_history": [entry],
        "task_state": branch.head.get("task_state") or {},
        "extra_state": branch.head.get("extra_state") or {},
        "moe": meta,
    }
