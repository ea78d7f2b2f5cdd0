"""The raw files an FSDP run of the moe/nllb branch leaves (``--ddp-backend fully_sharded --use-sharded-state``),
made here from a plain branch set (``branch_sets.write_branch_set``) in that layout.

Written from the branch's trainer / ``consolidate_fsdp_shards`` and fairscale 0.4's
``FullyShardedDataParallel`` (read, not copied): every worker r of W saves ``<P>-shared-shard<r>.pt``
(one flat parameter ``<fsdp_path>.flat_param_0`` per FSDP instance: the root, each encoder/decoder layer;
flattened in order, cut by ``torch.chunk`` into W pieces, each padded to the first's size; the tied output
projection is not flattened but named in the root's ``shared_param_info``; buffers whole) and
``<P>-rank-<r>-shard<r>.pt`` (each local expert an instance of its own over this worker alone: whole, no
padding, ``no_broadcast_optim_state``), both with the whole model's ``shard_metadata`` in fairscale's
``local_metadata_dict`` format and the run's cfg, args, history and optimizer state.
"""

import re
from pathlib import Path
from typing import Dict, List, Tuple

import torch

LAYER = re.compile(r"^((?:encoder|decoder)\.layers\.\d+)\.(.+)$")
BUFFER = re.compile(r"(^|\.)(version|_float_tensor)$")
EXPERT = re.compile(r"^(.+\.moe_layer\.experts\.\d+)\.(.+)$")
TIED = ("decoder.embed_tokens.weight", "decoder.output_projection.weight")


def _instances(model: Dict[str, torch.Tensor], pattern) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
    """{fsdp_path: [(name inside it, tensor)]} for the parameters (not buffers) of ``model``."""
    groups: Dict[str, List[Tuple[str, torch.Tensor]]] = {"": []} if pattern is LAYER else {}
    for key, tensor in model.items():
        if BUFFER.search(key):
            continue
        match = pattern.match(key)
        path, name = (match[1], match[2]) if match else ("", key)
        groups.setdefault(path, []).append((name, tensor))
    return groups


def _chunks(flat: torch.Tensor, world: int) -> List[Tuple[torch.Tensor, int]]:
    """fairscale's ``_get_shard`` for every rank: (padded chunk, padding)."""
    chunks = list(flat.chunk(world))
    chunks += [flat.new_empty(0)] * (world - len(chunks))
    size = chunks[0].numel()
    return [(torch.cat([c, c.new_zeros(size - c.numel())]), size - c.numel()) for c in chunks]


def _entry(path: str, params, padding: int, alone: bool, shared_info=()) -> Dict:
    spec = {"names": [n for n, _ in params], "shapes": [t.shape for _, t in params]}
    spec.update(numels=[t.numel() for _, t in params], padding=padding)
    return dict(fsdp_path=path, params={"flat_param_0": spec}, no_broadcast_optim_state=alone,
                shared_param_info=list(shared_info))  # fmt: skip


def shard_in_place(directory: Path, name: str = "ck") -> int:
    """Replace the plain set ``<directory>/<name>-*.pt`` by its FSDP shard files; returns the world W."""
    prefix = directory / name
    shared = torch.load(f"{prefix}-shared.pt", weights_only=False)["model"]
    rank_paths = sorted(directory.glob(f"{name}-rank-*.pt"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    world = len(rank_paths)
    tied = TIED[1] in shared and TIED[0] in shared and torch.equal(shared[TIED[1]], shared[TIED[0]])
    layers = _instances({k: v for k, v in shared.items() if not (tied and k == TIED[1])}, LAYER)
    buffers = [k for k in shared if BUFFER.search(k)]
    pieces = {path: _chunks(torch.cat([t.reshape(-1) for _, t in ps]), world) for path, ps in layers.items()}
    for rank, rank_path in enumerate(rank_paths):
        state = torch.load(rank_path, weights_only=False)
        experts = _instances(state["model"], EXPERT)
        metadata = [
            _entry(path, ps, pieces[path][rank][1], False, [TIED] if tied and not path else ())
            for path, ps in layers.items()
        ] + [_entry(path, ps, 0, True) for path, ps in experts.items()]
        meta = {"param_metadata": metadata, "buffer_names": buffers}
        head = {k: v for k, v in state.items() if k != "model"}
        head.update(shard_metadata=meta, last_optimizer_state={"state": {}, "param_groups": []})
        flat = {f"{p}.flat_param_0" if p else "flat_param_0": c[rank][0].clone() for p, c in pieces.items()}
        torch.save({**head, "model": {**flat, **{k: shared[k] for k in buffers}}}, f"{prefix}-shared-shard{rank}.pt")
        expert_flat = {f"{p}.flat_param_0": torch.cat([t.reshape(-1) for _, t in ps]) for p, ps in experts.items()}
        torch.save({**head, "model": expert_flat}, f"{prefix}-rank-{rank}-shard{rank}.pt")
        rank_path.unlink()
    Path(f"{prefix}-shared.pt").unlink()
    return world
