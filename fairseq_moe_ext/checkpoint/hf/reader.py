"""``HfShards``: the reader ``import-hf`` hands the set writer (set_writer.py), one output rank file at a time.

Output rank file s of P takes the stacked experts ``s*E/P ...`` of every MoE layer (and rank 0 every non-expert
tensor). Its stacked tensors are allocated once, whole, and each expert is read straight into its slot, by
seeking, in the order of the files that hold them (a safetensors tensor, a zip ``.bin`` shard's archive member:
each byte of every shard is read once for all the output files; a legacy pre-zip ``.bin`` shard is loaded whole,
once per output file that needs it, one at a time). So the memory an output file takes is that file, and no
copy of it: the hub's shards hold some experts of every MoE layer each, and every output file reads from all of them.
"""

from typing import Optional

import torch

from ..rank_state import moe_metadata
from .config import SIDES
from .keys import EMBEDDING, TIED_HERE, VERSION


class HfShards:
    """The reader of a checked NllbMoe directory, in ``dtype`` (None: as stored). ``where``: HF name -> the file
    holding it; ``names`` (our key -> HF name, (layer, tensor, expert) -> HF name), ``expert_layers``: ``plan``'s."""

    def __init__(self, hf_dir: str, options, where, names, expert_layers, dtype, shards: int, single: bool):
        self.hf_dir, self.options, self.where = hf_dir, options, where
        self.names, self.expert_names = names
        self.expert_layers, self.dtype, self.shards, self.single = expert_layers, dtype, shards, single
        self.expert_keys = [f"{layer}.fc1.experts.{tensor}" for layer, tensor in expert_layers]
        self.num_updates = 0
        self.experts = dict.fromkeys(self.expert_keys, options.moe_expert_count)
        self.order = {shard: i for i, shard in enumerate(dict.fromkeys(where.values()))}

    def _model(self, ids) -> dict:
        """Output file ``ids``'s model: rank 0's non-expert tensors, and the stacked experts ``ids`` of every layer,
        read file by file (a legacy .bin shard is loaded once for all it holds of this output file)."""
        model, slots = {}, {}
        for (layer, tensor), key in zip(self.expert_layers, self.expert_keys):
            first = self.expert_names[(layer, tensor, ids[0])]
            dtype = self.dtype or self.where[first].entries[first][0]
            stacked = model[key] = torch.empty((len(ids), *self.where[first].shape(first)), dtype=dtype)
            slots.update({self.expert_names[(layer, tensor, j)]: stacked[j - ids[0]] for j in ids})
        shared = {name: key for key, name in self.names.items()} if ids[0] == 0 else {}
        for name in sorted([*shared, *slots], key=lambda n: self.order[self.where[n]]):
            if name in shared:
                tensor = self.where[name].read(name)
                model[shared[name]] = tensor if self.dtype is None else tensor.to(self.dtype)
            else:
                self.where[name].read_into(name, slots[name])
        if shared:
            for key in TIED_HERE:  # one tensor: torch.save stores it once, fairseq ties them again
                model[key] = model[EMBEDDING]
            for side in SIDES:
                model[f"{side}.version"] = torch.tensor([VERSION])
        return model

    def pieces(self, set_id: Optional[str]):
        per = self.options.moe_expert_count // self.shards
        for shard in range(self.shards):
            model = self._model(range(shard * per, (shard + 1) * per))
            for held in self.order:
                held.release()
            meta = moe_metadata(
                [],
                self.expert_keys,
                world_size=1 if self.single else self.shards,
                rank=shard,
                num_updates=0,
                set_id=set_id,
                experts_per_worker=per,
            )
            meta["imported_from"] = self.hf_dir
            state = {
                "args": self.options,
                "cfg": None,
                "model": model,
                "criterion": {},
                "task_state": {},
                "extra_state": {},
                "moe": meta,
                "optimizer_history": [
                    {"optimizer_name": "none", "lr_scheduler_state": {"best": None}, "num_updates": 0}
                ],
            }
            yield shard, state
            del state, model
