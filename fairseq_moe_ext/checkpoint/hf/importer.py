"""``import-hf``: a Hugging Face NllbMoe checkpoint directory becomes this project's set.

Input: ``config.json`` (``hf_config.imported_options``: ``NllbMoeModel`` or ``NllbMoeForConditionalGeneration``)
and either ``model.safetensors`` or shards listed by ``model.safetensors.index.json`` (what ``save_pretrained``
writes), or else ``pytorch_model.bin`` or ``pytorch_model-*.bin`` shards listed by ``pytorch_model.bin.index.json``
(the older format, and the hub's ``facebook/nllb-moe-54b``; ``torch_bin_file.py``: read through the restricted
unpickler). Tensor names with or without the ``model.`` prefix (keys.py). Every shard's header (a .bin shard's
pickle) is read and checked first (present, complete, every tensor the config implies there with its shape), so
bad input is refused before a file is written. Then the reader ``HfShards`` (reader.py) yields output file r of
the set in turn and the set writer (set_writer.py) saves it: each tensor read on its own, by seeking, straight
into the output file's stacked experts, so each byte of every shard is read once for all the output files and
peak memory is one output file (plus one legacy pre-zip .bin shard, which is loaded whole), not the model.
Written staged and atomically, as the other tools.
"""

import json
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...moe.expert_layout import default_expert_parallel_size
from ..errors import CheckpointSetError
from ..names import base_of
from ..set_writer import write_shards
from .config import SIDES, imported_options
from .dtype import import_dtypes
from .keys import EMBEDDING, HF_EMBEDDING, HF_EMBEDDINGS, HF_TIED, hf_expert, our_key
from .reader import HfShards
from .safetensors_file import SafetensorsFile
from .torch_bin_file import TorchBinFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


def read_config(hf_dir: str) -> Dict:
    if not os.path.isdir(hf_dir):
        branch = [p for p in (hf_dir + "-shared.pt", hf_dir + "-rank-0.pt") if os.path.exists(p)]
        if branch:
            raise CheckpointSetError(
                f"{hf_dir} names a fairseq moe/nllb-branch set ({os.path.basename(branch[0])}): "
                f"use import-fairseq-moe for it (nothing was written)"
            )
        raise CheckpointSetError(
            f"{hf_dir} is not a directory: give a Hugging Face checkpoint directory (config.json "
            f"and safetensors files) (nothing was written)"
        )
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        found = sorted(f for f in os.listdir(hf_dir) if f.endswith("-shared.pt"))
        if found:
            raise CheckpointSetError(
                f"{hf_dir} holds a fairseq moe/nllb-branch set ({found[0]}), not a Hugging Face "
                f"checkpoint: use import-fairseq-moe for it (nothing was written)"
            )
        raise CheckpointSetError(
            f"{hf_dir} has no config.json: not a Hugging Face checkpoint directory (nothing was written)"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointSetError(f"cannot read {path}: {' '.join(str(e).split())} (nothing was written)") from None
    if not isinstance(config, dict):
        raise CheckpointSetError(f"{path} is not a JSON object: not a Hugging Face config (nothing was written)")
    return config


def open_shards(hf_dir: str) -> Dict[str, SafetensorsFile]:
    """Tensor name -> the checked shard that holds it (safetensors, else ``pytorch_model*.bin``)."""
    for index_name, single, kind in ((INDEX, SINGLE, SafetensorsFile), (BIN_INDEX, BIN_SINGLE, TorchBinFile)):
        index = os.path.join(hf_dir, index_name)
        if os.path.isfile(index) or os.path.isfile(os.path.join(hf_dir, single)):
            break
    else:
        raise CheckpointSetError(
            f"{hf_dir} has none of {INDEX}, {SINGLE}, {BIN_INDEX} or {BIN_SINGLE}: not a Hugging Face checkpoint "
            f"directory, or its weights were not downloaded (nothing was written)"
        )
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointSetError(
                f"cannot read {index}: {' '.join(str(e).split())}; restore it from the "
                f"checkpoint's source (nothing was written)"
            ) from None
    else:
        weight_map, files = None, [single]
    shards = {}
    for name in files:
        if os.path.basename(name) != name or not os.path.isfile(os.path.join(hf_dir, name)):
            raise CheckpointSetError(
                f"{index_name} names {name}, which is missing from {hf_dir}: download or copy the "
                f"whole checkpoint (nothing was written)"
            )
        shards[name] = kind(os.path.join(hf_dir, name))
    where = {}
    for name, shard in shards.items():
        where.update(dict.fromkeys(shard.entries, shard))
    for tensor, name in (weight_map or {}).items():
        if tensor not in shards[name].entries:
            raise CheckpointSetError(
                f"{index_name} places {tensor} in {name}, which does not hold it: files from "
                f"different checkpoints (nothing was written)"
            )
    return where


def expected_shapes(options) -> Tuple[Dict[str, List[int]], Dict[Tuple[str, str], List[int]]]:
    """(our non-expert key -> shape, (MoE layer, stacked name) -> one expert's shape) that ``options`` imply."""
    d = options.encoder_embed_dim
    shapes, experts = {}, {}
    for side in SIDES:
        hidden, freq = getattr(options, f"{side}_ffn_embed_dim"), getattr(options, f"{side}_moe_freq")
        for wb in ("weight", "bias"):
            shapes[f"{side}.layer_norm.{wb}"] = [d]
        for i in range(getattr(options, f"{side}_layers")):
            layer = f"{side}.layers.{i}"
            parts = ["self_attn"] + (["encoder_attn"] if side == "decoder" else [])
            for part in parts:
                for proj in ("q", "k", "v", "out"):
                    shapes[f"{layer}.{part}.{proj}_proj.weight"] = [d, d]
                    shapes[f"{layer}.{part}.{proj}_proj.bias"] = [d]
            for norm in [f"{p}_layer_norm" for p in parts] + ["final_layer_norm"]:
                shapes[f"{layer}.{norm}.weight"] = shapes[f"{layer}.{norm}.bias"] = [d]
            if freq > 0 and (i + 1) % freq == 0:
                shapes[f"{layer}.fc1.router.wg.weight"] = [options.moe_expert_count, d]
                experts.update(
                    {
                        (layer, "batched_fc1_w"): [hidden, d],
                        (layer, "batched_fc1_b"): [hidden],
                        (layer, "batched_fc2_w"): [d, hidden],
                        (layer, "batched_fc2_b"): [d],
                    }
                )
            else:
                shapes.update(
                    {
                        f"{layer}.fc1.weight": [hidden, d],
                        f"{layer}.fc1.bias": [hidden],
                        f"{layer}.fc2.weight": [d, hidden],
                        f"{layer}.fc2.bias": [d],
                    }
                )
    return shapes, experts


def plan(hf_dir: str, options, where: Dict[str, SafetensorsFile]):
    """(our key -> HF name, (layer, name, expert) -> HF name, vocabulary), checked against ``options``. The HF names
    may carry the ``model.`` prefix (``NllbMoeForConditionalGeneration``) or not (``NllbMoeModel``), not both."""
    shapes, expert_shapes = expected_shapes(options)
    embedding = next((n for n in (*HF_EMBEDDINGS, *HF_TIED) if n in where), None)
    if embedding is None:
        raise CheckpointSetError(
            f"{hf_dir} holds no {HF_EMBEDDING} (nor shared.weight): a shard is missing, or not an NllbMoe checkpoint "
            f"(nothing was written)"
        )
    vocab = where[embedding].shape(embedding)[0]
    shapes[EMBEDDING] = [vocab, options.encoder_embed_dim]
    names, expert_names = {EMBEDDING: embedding}, {}
    for name in where:
        found, ours = hf_expert(name), our_key(name)
        key, table = (found, expert_names) if found is not None else (ours, names)
        if key is None:
            if name in HF_TIED:
                continue
            raise CheckpointSetError(
                f"{hf_dir} holds {name}, which moe_transformer has no place for: not an NllbMoe "
                f"checkpoint this project can represent (nothing was written)"
            )
        if name in HF_EMBEDDINGS:
            continue
        if key in table:
            raise CheckpointSetError(
                f"{hf_dir} holds both {table[key]} and {name}: the files of two checkpoints (one saved with the "
                f"model. prefix, one without) in one directory; keep one checkpoint's (nothing was written)"
            )
        table[key] = name
    wanted = [(key, shape, names.get(key)) for key, shape in shapes.items()]
    wanted += [
        ((layer, tensor, j), shape, expert_names.get((layer, tensor, j)))
        for (layer, tensor), shape in expert_shapes.items()
        for j in range(options.moe_expert_count)
    ]
    for key, shape, name in wanted:
        if name is None:
            what = key if isinstance(key, str) else f"expert {key[2]} of {key[0]}"
            raise CheckpointSetError(
                f"{hf_dir} lacks the tensor for {what} that config.json implies: a shard is "
                f"missing, or the config belongs to another model (nothing was written)"
            )
        if where[name].shape(name) != shape:
            raise CheckpointSetError(
                f"{hf_dir}: {name} has shape {where[name].shape(name)}, but config.json implies "
                f"{shape}: files from different models (nothing was written)"
            )
    extra = sorted(set(names) - set(shapes))
    if extra:
        raise CheckpointSetError(
            f"{hf_dir} holds {names[extra[0]]}, which config.json does not place (a dense block "
            f"where the config says sparse, or the reverse) (nothing was written)"
        )
    return names, expert_names, sorted(expert_shapes), vocab


def import_hf(
    hf_dir: str,
    output: str,
    workers: int,
    report: Callable[[str], None] = print,
    dtype: Optional[torch.dtype] = None,
) -> str:
    """Import the NllbMoe directory ``hf_dir`` as ``output`` for ``workers`` workers; returns what was written.
    ``dtype``: cast every tensor to it; None keeps the dtype the Hugging Face files hold (``dtype.py``)."""
    if workers < 1:
        raise CheckpointSetError(f"--world-size must be a positive number of workers, got {workers}")
    config = read_config(hf_dir)
    options, notes = imported_options(config, os.path.join(hf_dir, "config.json"))
    where = open_shards(hf_dir)
    try:
        return _import(hf_dir, output, workers, report, dtype, options, notes, where)
    finally:
        for shard in set(where.values()):
            shard.close()


def _import(hf_dir, output, workers, report, dtype, options, notes, where) -> str:
    names, expert_names, expert_layers, vocab = plan(hf_dir, options, where)
    precision = import_dtypes({name: shard.entries[name][0] for name, shard in where.items()}, hf_dir, dtype)
    experts = options.moe_expert_count
    shards, single, base = default_expert_parallel_size(workers, experts), workers == 1, base_of(output)
    report(
        f"found {hf_dir}: NllbMoe, {experts} experts, {len(set(where.values()))} weight file(s), sparse steps "
        f"{options.encoder_moe_freq}/{options.decoder_moe_freq}, vocabulary {vocab}"
    )
    report(precision)
    for line in notes:
        report(f"NOTE {line}")
    reader = HfShards(hf_dir, options, where, (names, expert_names), expert_layers, dtype, shards, single)
    written = write_shards(reader, base, single=output if single else None, workers=workers)
    report(f"wrote {written}")
    return written
