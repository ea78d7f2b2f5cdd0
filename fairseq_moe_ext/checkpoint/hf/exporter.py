"""``export-hf``: a translation set becomes a Hugging Face NllbMoe checkpoint directory.

The output is what ``NllbMoeForConditionalGeneration.from_pretrained`` reads: ``config.json``
(``config.py``), safetensors shards ``model-0000X-of-0000N.safetensors`` of at most
``--max-shard-size`` bytes each (a tensor larger than that gets a shard of its own) and
``model.safetensors.index.json`` mapping every tensor to its shard. Names: ``keys.py``.

It streams: one rank file of the set is loaded at a time (rank 0, which holds the shared parameters,
first), and each output shard is written as soon as it is full. The tensors of an unwritten shard may
still belong to the previous rank file, so peak memory is one rank file plus one output shard (the
larger of ``--max-shard-size`` and the largest tensor), not the model. Shards are written under
temporary names and numbered once their count is known, all in a staging directory
(``staging.py``): the output directory holds nothing on any failure.
"""

import json
import os
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointSetError
from ..manifest import validate_set
from ..names import base_of, manifest_path
from ..resolve import resolve
from ..safe_load import safe_load
from ..staging import write_all_or_nothing
from .config import hf_config
from .dtype import check_expert_dtype, export_dtype, name_of
from .keys import EMBEDDING, NOT_WEIGHTS, TIED_HERE, expert_tensor, hf_expert_key, hf_key
from .safetensors_file import tensor_bytes, write_safetensors

INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# fmt: off
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}
# fmt: on


def shard_size(text: str) -> int:
    """``--max-shard-size``: bytes, or a number with KB/MB/GB (powers of 10) or KiB/MiB/GiB, as transformers'."""
    match = _SIZE.match(str(text))
    size = int(float(match[1]) * _UNITS[(match[2] or "B").upper()]) if match else 0
    if size < 1:
        raise CheckpointSetError(
            f"--max-shard-size {text!r} is not a size: give bytes or a number with KB, MB or GB "
            f"(e.g. 2GB) (nothing was written)"
        )
    return size


class ShardWriter:
    """Collects tensors and writes them as numbered safetensors shards of at most ``max_bytes``."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: List[Tuple[str, torch.Tensor]] = []
        self.pending_bytes, self.parts, self.total = 0, [], 0

    def add(self, name: str, tensor: torch.Tensor):
        size = tensor_bytes(tensor)
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending.append((name, tensor))
        self.pending_bytes += size
        self.total += size

    def flush(self):
        if not self.pending:
            return
        part = f"part-{len(self.parts)}.safetensors"
        write_safetensors(os.path.join(self.directory, part), self.pending, {"format": "pt"})
        self.parts.append((part, [name for name, _ in self.pending]))
        self.pending, self.pending_bytes = [], 0

    def finish(self) -> List[str]:
        """Number the shards, write the index; returns the file names, the index last."""
        self.flush()
        names, weight_map = [], {}
        for i, (part, tensors) in enumerate(self.parts):
            name = f"model-{i + 1:05d}-of-{len(self.parts):05d}.safetensors"
            os.replace(os.path.join(self.directory, part), os.path.join(self.directory, name))
            names.append(name)
            weight_map.update(dict.fromkeys(tensors, name))
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump(
                {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2
            )
        return names + [INDEX]


def rank_files(path: str) -> List[str]:
    """The files of the checkpoint ``path`` names, rank 0 first (one for a single file)."""
    resolved = resolve(path, fallback=False)
    if resolved is None:
        raise CheckpointSetError(
            f"no checkpoint named {path} (neither a file nor a set manifest "
            f"{manifest_path(base_of(path))}); give a set's name, e.g. "
            f"save_dir/checkpoint_best.pt"
        )
    if resolved.kind == "file":
        return [resolved.path]
    manifest = validate_set(resolved.path)
    directory = os.path.dirname(resolved.path)
    return [os.path.join(directory, f["name"]) for f in sorted(manifest["files"], key=lambda f: f["rank"])]


def model_options(state: Dict, path: str):
    cfg = state.get("cfg")
    options = cfg.get("model") if isinstance(cfg, dict) else None
    options = options if options is not None else state.get("args")
    if options is None or "moe" not in state:
        raise CheckpointSetError(
            f"{path} is not a checkpoint of this project's MoE models (no model options or no "
            f"'moe' metadata): export-hf exports moe_transformer sets (nothing was written)"
        )
    return options


def shared_tensors(model: Dict[str, torch.Tensor], expert_keys, path: str) -> List[Tuple[str, torch.Tensor]]:
    """Rank 0's non-expert parameters under their NllbMoe names (checked before anything is written)."""
    out = []
    for key, tensor in model.items():
        if key in expert_keys or NOT_WEIGHTS.match(key):
            continue
        if key in TIED_HERE:
            if not torch.equal(tensor, model[EMBEDDING]):
                raise CheckpointSetError(
                    f"{path}: {key} differs from {EMBEDDING}, but NllbMoe ties them: export a "
                    f"model trained with --share-all-embeddings (nothing was written)"
                )
            continue
        name = hf_key(key)
        if name is None:
            raise CheckpointSetError(
                f"{path} holds {key}, which NllbMoe has no place for: export-hf exports "
                f"moe_transformer models NllbMoe can express (nothing was written)"
            )
        out.append((name, tensor))
    return out


def export_hf(
    checkpoint: str,
    out_dir: str,
    max_bytes: int,
    report: Callable[[str], None] = print,
    training_as_nllb: bool = False,
    dtype: Optional[torch.dtype] = None,
) -> List[str]:
    """Write the set ``checkpoint`` names as an NllbMoe directory ``out_dir``; returns the files written.
    ``training_as_nllb``: export a set trained with options that act in training only and NllbMoe lacks.
    ``dtype``: cast every tensor to it as it is written (``dtype.py``); None writes the set's own."""
    if os.path.lexists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CheckpointSetError(
            f"{out_dir} exists and is not an empty directory; choose a new output directory (nothing was overwritten)"
        )
    paths = rank_files(checkpoint)
    first = safe_load(paths[0], verified=len(paths) > 1)
    options, model = model_options(first, paths[0]), first["model"]
    expert_keys = set(first["moe"].get("expert_keys", []))
    embedding = model.get(EMBEDDING, torch.empty(0))
    # refuses a language model
    config, notes = hf_config(options, paths[0], int(embedding.shape[0]), "float32", training_as_nllb)
    if EMBEDDING not in model:
        raise CheckpointSetError(
            f"{paths[0]} holds no {EMBEDDING}: not rank 0 of a translation set (nothing was written)"
        )
    shared = shared_tensors(model, expert_keys, paths[0])
    rank0 = [(key, tensor) for key, tensor in model.items() if not NOT_WEIGHTS.match(key)]
    target = export_dtype(rank0, paths[0], dtype)
    config["torch_dtype"] = name_of(target)
    held = sorted({name_of(t.dtype) for _, t in rank0})
    report(
        f"found {checkpoint}: {len(paths)} rank file(s), {config['num_experts']} experts, "
        f"sparse steps {config['encoder_sparse_step']}/{config['decoder_sparse_step']}, "
        + (f"{'/'.join(held)} weights cast to {name_of(target)} (--dtype)" if dtype is not None else name_of(target))
    )
    del rank0
    for line in notes:
        report(f"NOTE {line}")
    created = not os.path.lexists(out_dir)
    if created:
        try:
            os.mkdir(out_dir)
        except OSError as e:
            raise CheckpointSetError(
                f"cannot create {out_dir}: {e.strerror}; create its parent directory first (nothing was written)"
            ) from None

    def write(staging):
        nonlocal first, model, shared
        writer = ShardWriter(staging, max_bytes)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        for name, tensor in shared:
            writer.add(name, tensor.to(target))  # a cast copy lives only in the pending shard
        shared = None
        for rank, path in enumerate(paths):
            state = first if rank == 0 else safe_load(path, verified=True)
            first = model = None  # rank 0's state lives on only in what the writer still holds
            add_experts(writer, state, path, int(config["num_experts"]), len(paths), target, dtype is not None)
            del state
        return ["config.json"] + writer.finish()

    try:
        written = write_all_or_nothing(out_dir, f"the Hugging Face checkpoint {out_dir}", write)
    except BaseException:
        if created:
            os.rmdir(out_dir)
        raise
    report(f"wrote {out_dir} ({len(written) - 2} safetensors shard(s))")
    return written


def add_experts(
    writer: ShardWriter,
    state: Dict,
    path: str,
    experts: int,
    files: int,
    dtype: torch.dtype = torch.float32,
    cast: bool = True,
) -> None:
    """One rank file's experts, one tensor per expert under its global id, as ``dtype`` (without ``cast``,
    a file whose experts are of another dtype is refused)."""
    local = experts // files
    rank = int(state["moe"].get("rank", 0))
    for key in state["moe"].get("expert_keys", []):
        found = expert_tensor(key)
        stacked = state["model"].get(key)
        if found is None or stacked is None or stacked.shape[0] != local:
            raise CheckpointSetError(
                f"{path}: expert tensor {key} is not a stack of {local} experts of an MoE "
                f"feed-forward block (nothing was written)"
            )
        if not cast:
            check_expert_dtype(stacked, dtype, key, path)
        for j in range(local):
            writer.add(hf_expert_key(*found, rank * local + j), stacked[j].to(dtype))
