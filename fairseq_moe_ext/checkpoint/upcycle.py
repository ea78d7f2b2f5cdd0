"""Sparse upcycling (Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from
Dense Checkpoints"): a dense fairseq checkpoint becomes an MoE one that computes the same function.

In every layer chosen for MoE, the dense feed-forward block ``fc1 -> activation -> fc2`` becomes E
experts that are each a copy of it (``fc1.experts.batched_fc1_w`` etc., stacked along dim 0 as
``moe/experts.py`` stores them; optional seeded Gaussian noise) and a router
(``fc1.router.wg.weight``) that starts at small seeded random weights (or at zero, if asked: then
every token ties and picks the same k experts). With the k gates
renormalised to sum to 1 (``--moe-normalize-gate``) and dropless routing, the MoE output is
``sum_j g_j FFN(x) = FFN(x)`` whichever experts the router picks, ties included: the upcycled model
is the dense model until training changes it. Every other parameter, and the layers not chosen
(kept dense), carry over unchanged.

Torch only, like the rest of ``checkpoint/``: which layers become MoE is read from the MoE config's
``--moe-freq`` flags as the models read them (``options.moe_freq``); the config is converted by the
caller.
"""

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

# The routers' default initial std: --moe-upcycle-router-std's record says why 0.01.
from ..moe.placement import is_moe_layer
from ..options.run import DEFAULT_ROUTER_STD
from ..options.sides import sides_of
from .contents import check_is_checkpoint, is_dense
from .errors import CheckpointSetError
from .rank_state import moe_metadata

# fairseq's transformer layers: <side>.layers.<i>.fc1 / fc2 (nn.Linear, with biases).
FFN_WEIGHT = re.compile(r"^(?P<side>encoder|decoder)\.layers\.(?P<index>\d+)\.fc1\.weight$")
# dense parameter -> the experts' stacked tensor that holds E copies of it
# fmt: off
EXPERT_TENSORS = (("fc1.weight", "fc1.experts.batched_fc1_w"), ("fc1.bias", "fc1.experts.batched_fc1_b"),
                  ("fc2.weight", "fc1.experts.batched_fc2_w"), ("fc2.bias", "fc1.experts.batched_fc2_b"))
# fmt: on
ROUTER_WEIGHT = "fc1.router.wg.weight"


# fmt: off
@dataclass(frozen=True)
class UpcycleOptions:
    experts: int
    noise: float = 0.0  # std of Gaussian noise added to every expert tensor (0: exact copies)
    router_std: float = DEFAULT_ROUTER_STD  # std of the router's initial weights (0: zero, every token ties)
    seed: int = 1  # the noise's and the router's generator
    expert_ffn_dim: int = None  # the --moe-expert-ffn-dim asked for (None: the dense FFN's)
# fmt: on


def dense_ffn_layers(model_state: Dict) -> List[Tuple[str, int]]:
    """(side, layer index) of every fairseq FFN block in a model state, in order."""
    found = [FFN_WEIGHT.match(key) for key in model_state]
    return sorted((m["side"], int(m["index"])) for m in found if m)


def check_upcyclable(state, path: str, options: UpcycleOptions) -> Dict:
    """``state`` if it is a dense fairseq checkpoint with FFN blocks the options fit; else one line."""
    state = check_is_checkpoint(state, path)
    if not is_dense(state):
        raise CheckpointSetError(
            f"{path} is already an MoE checkpoint (it holds experts): upcycling starts from a dense fairseq "
            f"checkpoint; train on from this one with --restore-file, or reshard it"
        )
    layers = dense_ffn_layers(state["model"])
    if not layers:
        raise CheckpointSetError(
            f"{path} has no fairseq feed-forward block (no encoder/decoder.layers.N.fc1/fc2 weights): upcycling "
            f"needs a dense checkpoint of an architecture whose FFN is fc1/fc2 (transformer, transformer_lm)"
        )
    if options.experts < 1:
        raise CheckpointSetError(
            f"--moe-expert-count must be a positive integer, got {options.experts}: use 1 or more experts"
        )
    for side, index in layers:
        hidden = state["model"][f"{side}.layers.{index}.fc1.weight"].shape[0]
        if options.expert_ffn_dim is not None and options.expert_ffn_dim != hidden:
            raise CheckpointSetError(
                f"--moe-expert-ffn-dim {options.expert_ffn_dim} differs from the dense FFN's hidden size {hidden} "
                f"({side}.layers.{index}.fc1 in {path}): every expert starts as a copy of the dense FFN; drop "
                f"--moe-expert-ffn-dim or pass {hidden}"
            )
        for dense_name, _ in EXPERT_TENSORS:
            if f"{side}.layers.{index}.{dense_name}" not in state["model"]:
                raise CheckpointSetError(
                    f"{path} has {side}.layers.{index}.fc1.weight but no {side}.layers.{index}.{dense_name}: "
                    f"upcycling needs fairseq's fc1/fc2 with biases (a transformer or transformer_lm checkpoint)"
                )
    return state


def upcycle_model_state(
    model_state: Dict, options: UpcycleOptions, moe_layer: Callable[[str, int], bool]
) -> Tuple[Dict, List[str]]:
    """The MoE model state and its expert keys; ``moe_layer(side, index)``: is that layer MoE?"""
    chosen = [(side, index) for side, index in dense_ffn_layers(model_state) if moe_layer(side, index)]
    if not chosen:
        raise CheckpointSetError(
            "the MoE layer frequency places no MoE layer among the checkpoint's layers: use a --moe-freq (or "
            "--encoder-/--decoder-moe-freq) between 1 and the number of layers"
        )
    generator = torch.Generator().manual_seed(int(options.seed))
    out, expert_keys = dict(model_state), []
    for side, index in chosen:  # sorted: the noise does not depend on the checkpoint's key order
        prefix = f"{side}.layers.{index}"
        for dense_name, expert_name in EXPERT_TENSORS:
            dense = out.pop(f"{prefix}.{dense_name}")
            experts = dense.unsqueeze(0).repeat(options.experts, *([1] * dense.dim()))
            if options.noise > 0:
                noise = torch.randn(experts.shape, generator=generator, dtype=torch.float32) * options.noise
                experts = (experts.float() + noise).to(dense.dtype)
            out[f"{prefix}.{expert_name}"] = experts
            expert_keys.append(f"{prefix}.{expert_name}")
        model_dim = model_state[f"{prefix}.fc1.weight"].shape[1]
        router = torch.zeros(options.experts, model_dim, dtype=torch.float32)
        if options.router_std > 0:
            router = torch.randn(router.shape, generator=generator) * options.router_std
        out[f"{prefix}.{ROUTER_WEIGHT}"] = router.to(model_state[f"{prefix}.fc1.weight"].dtype)
    return out, expert_keys


def upcycle_state(dense: Dict, path: str, options: UpcycleOptions, model_cfg, cfg) -> Dict:
    """The whole MoE checkpoint (every expert, world size 1, update 0) for the MoE ``cfg``, its layers
    placed by ``model_cfg``'s MoE frequencies: a fresh start, so no optimizer state, no training
    progress (fairseq then starts at epoch 1, update 0)."""
    dense = check_upcyclable(dense, path, options)
    freqs = {side.name: side.moe_freq for side in sides_of(model_cfg)}
    model, expert_keys = upcycle_model_state(dense["model"], options, lambda side, i: is_moe_layer(i, freqs[side]))
    meta = moe_metadata([], expert_keys, world_size=1, rank=0, num_updates=0, experts_per_worker=options.experts)
    meta["upcycled_from"] = path
    return {
        "args": None,
        "cfg": cfg,
        "model": model,
        "criterion": dense.get("criterion", {}),
        # fairseq's loaders need a history entry and a data-iterator state: those of update 0, epoch 1.
        # No last_optimizer_state: the trainer keeps the fresh optimizer it built.
        "optimizer_history": [dict(_last_history_entry(dense), num_updates=0)],
        "task_state": dense.get("task_state", {}),
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0, "shuffle": True, "version": 2}},
        "moe": meta,
    }


def _last_history_entry(dense: Dict) -> Dict:
    history = dense.get("optimizer_history") or [{}]
    entry = {k: v for k, v in history[-1].items() if k != "optimizer"}
    entry.setdefault("optimizer_name", "none")
    entry.setdefault("lr_scheduler_state", {"best": None})
    return entry
