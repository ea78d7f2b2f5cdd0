"""The raw FSDP files of a moe/nllb-branch run (``--ddp-backend fully_sharded --use-sharded-state``).

What they hold (the branch's trainer, ``moe_checkpoint_utils.split_shared_and_expert_states`` and
``consolidate_fsdp_shards``; fairscale 0.4's ``FullyShardedDataParallel.local_metadata_dict`` and
``consolidate_shard_weights``, read, not copied): every rank r of W wrote ``<P>-shared-shard<r>.pt``
(the shared parameters: one flat parameter per FSDP instance, ``<fsdp_path>.flat_param_0``, flattened in
the instance's order, cut into W equal chunks, this rank's chunk padded at its end) and
``<P>-rank-<r>-shard<r>.pt`` (its experts: each expert is an FSDP instance of its own whose group holds
this rank only, so its flat parameter is whole), each with the run's cfg, args, history and a
``shard_metadata``: the whole model's ``{param_metadata: [{fsdp_path, params: {flat name: {names,
shapes, numels, padding}}, no_broadcast_optim_state, shared_param_info}], buffer_names}``. The branch
joins the W shared files in one ``consolidate_shard_weights`` call (instances a file lacks are skipped)
and un-flattens each expert file alone. So does this module, one file at a time, and hands the branch's
consolidated dicts to ``BranchSet`` (``reader.py``): the import is the consolidated set's.

Peak memory: the shared parameters once (the W shared files' chunks, kept as they are read, one file
loaded at a time) plus the largest flat parameter while it is joined; then one expert file at a time.
Only fairscale 0.4's metadata (the keys above, exactly) is read; anything else is refused. Where
fairscale copies only the last instance's ``shared_param_info`` (tied weights), every instance's is
applied here, so a tied output projection is kept as the plain set has it.
"""

import math
import os
import re
from typing import Dict, List, Optional

import torch

from ..errors import CheckpointSetError
from ..safe_load import safe_load

SHARED_SHARD = re.compile(r"-shared-shard(\d+)\.pt$")
RANK_SHARD = re.compile(r"-rank-(\d+)-shard(\d+)\.pt$")
METADATA_KEYS = ["buffer_names", "param_metadata"]
INSTANCE_KEYS = ["fsdp_path", "no_broadcast_optim_state", "params", "shared_param_info"]
PARAM_KEYS = ["names", "shapes", "numels", "padding"]
HEAD = ("cfg", "args", "extra_state", "optimizer_history", "task_state")
NOTHING = " (nothing was written)"
MIXED = "shards of different worlds mixed, or one missing; import one run's complete set of -shard files"
# With fewer experts than workers, the branch's FSDP shards each expert over its replicas (fsdp_wrap_expert's
# expert_group); its consolidate_fsdp_shards reads each expert file alone and cannot join those either.
REPLICAS = (
    "an expert sharded over its replicas, as a run with fewer experts than workers saves it: the branch's "
    "consolidate_fsdp_shards cannot join those either, and neither can this import"
)


class FsdpShards:
    """The ``-shard`` files of the run at ``prefix``: ``shared_path`` names the W shared files, ``rank_paths``
    are the expert files; ``load(path)`` gives what the branch's consolidation writes for it."""

    def __init__(self, prefix: str, files: List[str]):
        self.prefix = prefix
        shared: Dict[int, str] = {}
        ranks: Dict[int, str] = {}
        for path in files:
            if (match := SHARED_SHARD.search(path)) and path == f"{prefix}-shared-shard{int(match[1])}.pt":
                shared[int(match[1])] = path
            elif (match := RANK_SHARD.search(path)) and path[: match.start()] == prefix:
                if int(match[1]) != int(match[2]) or path != f"{prefix}-rank-{int(match[1])}-shard{int(match[2])}.pt":
                    raise CheckpointSetError(
                        f"{path}: an expert file's rank and shard numbers differ; the branch writes "
                        f"-rank-<r>-shard<r>.pt: a file from another run, move it away{NOTHING}"
                    )
                ranks[int(match[1])] = path
        world = max([*shared, *ranks, -1]) + 1
        for number, found, name in ((shared, shared, "shared-shard{}"), (ranks, ranks, "rank-{0}-shard{0}")):
            missing = [r for r in range(world) if r not in found]
            if missing:
                raise CheckpointSetError(
                    f"{prefix}-{name.format(missing[0])}.pt is missing (shard files of {world} workers are here): "
                    f"every worker's -shared-shard and -rank-shard file is needed; copy it beside the others{NOTHING}"
                )
        self.world = world
        self.shared_files = [shared[r] for r in range(world)]
        self.shared_path = f"{prefix}-shared-shard*.pt"
        self.rank_paths = [ranks[r] for r in range(world)]

    def note(self) -> str:
        return f"joining {self.world} FSDP shards ({os.path.basename(self.prefix)}-shared-shard0..{self.world - 1}.pt)"

    def load(self, path: str) -> Dict:
        if path == self.shared_path:
            return self._join_shared()
        state = _read(path)
        model = _consolidate([state["model"]], [state["shard_metadata"]], [path], REPLICAS)
        return {**{k: state.get(k) for k in HEAD}, "model": model}

    def _join_shared(self) -> Dict:
        """The shared files, read one at a time; each keeps only its (unpadded) flat parameter chunks."""
        weights, metadata, head = [], [], {}
        for rank, path in enumerate(self.shared_files):
            state = _read(path)
            if rank == 0:
                head = {k: state.get(k) for k in HEAD}
            meta = state["shard_metadata"]
            wanted = set(_flat_keys(meta)) | set(meta["buffer_names"] if rank == 0 else ())
            weights.append({k: v for k, v in state["model"].items() if k in wanted})
            metadata.append(meta)
            del state
        model = _consolidate(weights, metadata, self.shared_files)
        return {**head, "model": model}


def fsdp_shards(prefix: str, files: List[str]) -> Optional[FsdpShards]:
    return FsdpShards(prefix, files) if files else None


def _read(path: str) -> Dict:
    state = safe_load(path)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "shard_metadata" not in state:
        raise CheckpointSetError(
            f"{path} holds no shard_metadata: not a file an FSDP run with --use-sharded-state wrote (its "
            f"-shard name is wrong, or it was edited); import the run's own shard files{NOTHING}"
        )
    _check_metadata(state["shard_metadata"], path)
    return state


def _check_metadata(meta, path: str) -> None:
    """fairscale 0.4's ``local_metadata_dict`` exactly, or a one-line refusal."""
    ok = isinstance(meta, dict) and sorted(meta) == METADATA_KEYS and isinstance(meta["param_metadata"], list)
    for instance in meta["param_metadata"] if ok else ():
        ok = ok and isinstance(instance, dict) and sorted(instance) == INSTANCE_KEYS
        ok = ok and isinstance(instance["params"], dict)
        for value in instance["params"].values() if ok else ():
            ok = ok and isinstance(value, dict) and list(value) == PARAM_KEYS
            ok = ok and len(value["names"]) == len(value["shapes"]) == len(value["numels"])
            ok = ok and all(math.prod(s) == n for s, n in zip(value["shapes"], value["numels"]))
    if not ok:
        seen = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointSetError(
            f"{path}: its shard_metadata ({seen}) is not fairscale 0.4's local_metadata_dict format ({METADATA_KEYS}, "
            f"each instance {INSTANCE_KEYS}, each flat parameter {PARAM_KEYS}): written by a fairscale version "
            f"this import does not know; consolidate with the branch's consolidate_fsdp_shards and pass the "
            f"prefix again{NOTHING}"
        )


def _key(fsdp_path: str, name: str) -> str:
    return f"{fsdp_path}.{name}" if fsdp_path else name


def _flat_keys(meta) -> List[str]:
    return [_key(i["fsdp_path"], b) for i in meta["param_metadata"] for b in i["params"]]


def _consolidate(weights: List[Dict], metadata: List[Dict], paths: List[str], hint=MIXED) -> Dict[str, torch.Tensor]:
    """fairscale's ``consolidate_shard_weights(weights, metadata, strict=False)``, checked."""
    out: Dict[str, torch.Tensor] = {}
    first = metadata[0]["param_metadata"]
    for rank, meta in enumerate(metadata[1:], 1):
        if _layout(meta["param_metadata"]) != _layout(first):
            raise CheckpointSetError(
                f"{paths[rank]} and {paths[0]} describe different models in their shard_metadata: shards of "
                f"different runs or worlds mixed; import one run's files{NOTHING}"
            )
    for index, instance in enumerate(first):
        for backing, spec in instance["params"].items():
            key = _key(instance["fsdp_path"], backing)
            if key not in weights[0]:
                continue  # the other file's part (experts in the shared files, the rest in an expert file)
            chunks = []
            for rank in range(len(weights)):  # fairscale reads shard 0 alone for no_broadcast_optim_state
                # instances: in the branch those are the experts, one file each; elsewhere: refused below
                if key not in weights[rank]:
                    raise CheckpointSetError(
                        f"{paths[rank]} lacks {key}, which {paths[0]} holds: shards of different runs{NOTHING}"
                    )
                chunk = weights[rank].pop(key)
                pad = metadata[rank]["param_metadata"][index]["params"][backing]["padding"]
                if chunk.dim() != 1 or not 0 <= pad <= chunk.numel():
                    raise CheckpointSetError(
                        f"{paths[rank]}: {key} has shape {list(chunk.shape)} and padding {pad} in its shard_metadata: "
                        f"the metadata disagrees with the tensors; the file was edited or is another run's{NOTHING}"
                    )
                chunks.append(chunk[: chunk.numel() - pad])
            full = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            del chunks
            if sum(spec["numels"]) != full.numel():
                where = paths[0] if len(paths) == 1 else f"{paths[0]} ... {os.path.basename(paths[-1])}"
                raise CheckpointSetError(
                    f"{where}: {key} joined from {len(weights)} shard(s) holds {full.numel()} values, but its "
                    f"shard_metadata's parameters need {sum(spec['numels'])}: the metadata disagrees with the "
                    f"tensors ({hint}){NOTHING}"
                )
            for name, part, shape in zip(spec["names"], full.split(list(spec["numels"])), spec["shapes"]):
                out[_key(instance["fsdp_path"], name)] = part.view(shape)
    for instance in first:
        for source, dest in instance["shared_param_info"]:
            source, dest = _key(instance["fsdp_path"], source), _key(instance["fsdp_path"], dest)
            if source in out:
                out[dest] = out[source]
    for name in metadata[0]["buffer_names"]:
        if name in weights[0]:
            out[name] = weights[0][name]
    return out


def _layout(param_metadata) -> List:
    return [
        (i["fsdp_path"], [(b, list(p["names"]), list(p["numels"])) for b, p in i["params"].items()])
        for i in param_metadata
    ]
