"""fairseq ``moe``/``nllb``-branch checkpoint sets written by the tests, in that branch's layout.

Written here from the branch's ``checkpoint_utils.py`` and ``moe_checkpoint_utils.py`` (read, not
copied): rank r's ``<prefix>-rank-<r>.pt`` holds its experts under local numbers
(``<layer>.moe_layer.experts.<j>.fc1|fc2.weight|bias``: parameter names containing "expert") with
the run's cfg, args, optimizer history and extra state; ``<prefix>-shared.pt`` holds every other
parameter, the routers ``<layer>.moe_layer.gate.wg.weight`` included. With E >= R files rank r
holds experts ``r*E/R ...``; with E < R, expert ``r % E``.
"""

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Dict, Optional

import numpy
import torch

OUR_EXPERT = re.compile(r"^(?P<layer>.*)\.fc1\.experts\.batched_(?P<name>fc1_w|fc1_b|fc2_w|fc2_b)$")
BRANCH_NAME = {"fc1_w": "fc1.weight", "fc1_b": "fc1.bias", "fc2_w": "fc2.weight", "fc2_b": "fc2.bias"}

# What the branch's TransformerConfig holds for an NLLB-200-MoE-like run (besides the transformer's own).
# fmt: off
BRANCH_MOE_OPTIONS = dict(moe_freq=2, encoder_moe_freq=0, decoder_moe_freq=0, moe_second_expert_policy="all",
                          moe_normalize_gate_prob_before_dropping=False, moe_eval_capacity_token_fraction=1.0,
                          moe_gating_use_fp32=True, moe_eom=0.0, moe_fom=0.0, moe_cmr=False, moe_top1_expert=False,
                          moe_local_drop=0.0, moe_normalize_expert_grad="sqrt_world_size", use_moe_pad_mask=False,
                          moe_batch_prioritized_routing=False, alternate_ffn_embed_dim=0,
                          alternate_decoder_ffn_embed_dim=0, base_layers=0, use_tutel_moe=False)
# fmt: on
# fmt: off
OUR_ONLY = ("moe_top_k", "moe_capacity_factor", "moe_eval_capacity_factor", "moe_normalize_gate", "moe_router",
            "moe_gate_noise", "moe_gating_no_fp32")
# fmt: on


def branch_model_options(our_model_args, experts: int, **changes) -> argparse.Namespace:
    """Our built model's args as the branch would have stored them (``arch transformer``, its MoE options)."""
    options = {k: v for k, v in vars(our_model_args).items() if k not in OUR_ONLY}
    options.update(BRANCH_MOE_OPTIONS, arch="transformer", _name="transformer", moe_expert_count=experts)
    options.update(changes)
    return argparse.Namespace(**options)


def branch_options(data, experts: int = 4, **changes) -> argparse.Namespace:
    """branch_model_options of a ``moe_transformer_tiny`` translation model with ``experts`` experts on
    the dictionaries in ``data`` (what an import test writes its branch set with)."""
    from fairseq import options as fairseq_options
    from support.launch.fairseq_helpers import USER_DIR

    flags = ["--user-dir", USER_DIR, "--task", "translation", "--arch", "moe_transformer_tiny", "--cpu"]
    flags += ["--source-lang", "src", "--target-lang", "tgt", "--moe-expert-count", str(experts)]
    args = fairseq_options.parse_args_and_arch(fairseq_options.get_training_parser(), [str(data), *flags])
    return branch_model_options(args, experts, **changes)


# The MoE options of the moe branch's TransformerLanguageModelConfig (fairseq/models/transformer_lm.py there),
# as a moe_lm run (examples/moe_lm, README.moe.md there) sets them, with an eval capacity that drops nothing.
# fmt: off
BRANCH_LM_MOE_OPTIONS = dict(moe_freq=2, moe_gating_use_fp32=True, moe_second_expert_policy="all",
                             moe_normalize_gate_prob_before_dropping=False, moe_expert_ffn_dim=None,
                             moe_top1_expert=False, moe_eval_capacity_token_fraction=1.0,
                             moe_normalize_expert_grad="sqrt_world_size", use_moe_pad_mask=False,
                             record_a2a_perf_stats=False, dummy_a2a=False, moe_batch_prioritized_routing=False,
                             use_stable_embedding=False, alternate_decoder_ffn_embed_dim=0, base_layers=0,
                             base_sublayers=1, base_shuffle=1, fp16_no_flatten_grads=False, world_size=1,
                             distributed_rank=0)
# fmt: on


def branch_lm_options(our_model_cfg: Dict, experts: int, **changes) -> Dict:
    """Our language model's cfg["model"] as the moe branch stored its ``transformer_lm``'s: a dict (a
    dataclass model) of stock transformer_lm options plus the branch's MoE options, none of ours."""
    from fairseq_moe_ext.models.moe_config import MoEEncoderDecoderConfig

    ours = {f.name for f in dataclasses.fields(MoEEncoderDecoderConfig)}
    options = {k: v for k, v in dict(our_model_cfg).items() if k not in ours}
    options.update(
        BRANCH_LM_MOE_OPTIONS,
        _name="transformer_lm",
        arch="transformer_lm_gpt",
        moe_expert_count=experts,
        moe_freq=our_model_cfg["moe_freq"],
    )
    options.update(changes)
    return options


def branch_model_state(model_state: Dict[str, torch.Tensor]):
    """(shared state, {(layer, tensor name): [E tensors]}) from one of our full model states."""
    shared, experts = {}, {}
    for key, tensor in model_state.items():
        match = OUR_EXPERT.match(key)
        if match:
            experts[(match["layer"], BRANCH_NAME[match["name"]])] = list(tensor.clone().unbind(0))
        elif key.endswith(".fc1.router.wg.weight"):
            shared[key.replace(".fc1.router.wg.weight", ".moe_layer.gate.wg.weight")] = tensor.clone()
        else:
            shared[key] = tensor.clone()
    return shared, experts


def write_branch_set(prefix: Path, model_state, options: argparse.Namespace, ranks: int, **written) -> Path:
    """Write ``<prefix>-shared.pt`` and ``<prefix>-rank-<r>.pt`` for ``ranks`` workers; returns the prefix.

    ``options`` is a translation model's Namespace, or a language model's dict (``branch_lm_options``):
    a moe_lm run's task is ``task`` (its cfg["task"]) and its criterion ``moe_cross_entropy``. ``written``:
    ``write_branch_parts``'s other keywords (num_updates, cfg_as_dict, declared_world, task)."""
    shared, experts = branch_model_state(model_state)
    return write_branch_parts(prefix, shared, experts, options, ranks, **written)


def write_branch_parts(
    prefix: Path,
    shared: Dict[str, torch.Tensor],
    experts,
    options: argparse.Namespace,
    ranks: int,
    num_updates: int = 300,
    cfg_as_dict: bool = True,
    declared_world: Optional[int] = None,
    task: Optional[Dict] = None,
) -> Path:
    """``write_branch_set`` from the branch's own names: ``shared`` (every non-expert tensor) and
    ``experts`` ({(layer, "fc1.weight" ...): [one tensor per global expert]})."""
    count = len(next(iter(experts.values())))
    world = ranks if declared_world is None else declared_world
    lm = isinstance(options, dict)
    criterion = {"_name": "moe_cross_entropy", "moe_gate_loss_wt": 0.01, "moe_gate_loss_combine_method": "sum"}
    if not lm:
        criterion.update(_name="moe_label_smoothed_cross_entropy", label_smoothing=0.1, moe_cmr_loss_wt=0.0)
    cfg = {
        "_name": None,
        "common": {"seed": 2},
        "model": options,
        "task": task or {"_name": "translation_multi_simple_epoch"},
        "criterion": criterion,
        "distributed_training": {"distributed_world_size": world},
    }
    head = {
        "cfg": cfg if cfg_as_dict else None,
        "args": None
        if cfg_as_dict
        else argparse.Namespace(**{**(options if lm else vars(options)), "distributed_world_size": world}),
        # numpy scalars, as the branch's meters leave them in extra_state
        "extra_state": {
            "train_iterator": {"epoch": 3, "iterations_in_epoch": 0, "shuffle": True, "version": 2},
            "best": numpy.float64(2.5),
        },
        "optimizer_history": [
            {
                "criterion_name": "MoELabelSmoothedCrossEntropyCriterion",
                "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": 2.5},
                "num_updates": num_updates,
            }
        ],
    }
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # The branch's data-parallel master writes the shared file from the same state dict, head included.
    torch.save(
        {**head, "model": shared, "last_optimizer_state": {"state": {}, "param_groups": []}}, f"{prefix}-shared.pt"
    )
    for rank in range(ranks):
        ids = [rank * (count // ranks) + j for j in range(count // ranks)] if count >= ranks else [rank % count]
        model = {
            f"{layer}.moe_layer.experts.{j}.{name}": tensors[gid].clone()
            for (layer, name), tensors in experts.items()
            for j, gid in enumerate(ids)
        }
        torch.save({**head, "model": model}, f"{prefix}-rank-{rank}.pt")
    return prefix


def consolidate_in_place(directory: Path, name: str = "ck") -> Path:
    """Turn the plain set ``<directory>/<name>`` into what an FSDP run of it leaves after the branch's
    ``consolidate_fsdp_shards(<name>)``: ``<name>_consolidated-shared.pt`` (the dense parameters in
    another order, as ``consolidate_shard_weights`` emits them per FSDP instance, with the run's cfg,
    args, extra state and optimizer history; no optimizer state) and ``<name>_consolidated-rank-<r>.pt``,
    beside the training's ``-shard`` files (stand-ins: only their names matter here). Returns the training
    prefix."""
    prefix = directory / name
    rank0 = torch.load(f"{prefix}-rank-0.pt", weights_only=False)
    head = {k: rank0[k] for k in ("cfg", "args", "extra_state", "optimizer_history")}
    shared = torch.load(f"{prefix}-shared.pt", weights_only=False)["model"]
    torch.save({"model": dict(reversed(list(shared.items()))), **head}, f"{prefix}_consolidated-shared.pt")
    Path(f"{prefix}-shared.pt").rename(f"{prefix}-shared-shard0.pt")
    ranks = sorted(directory.glob(f"{name}-rank-*.pt"))
    for path in ranks:
        rank = path.name[len(name) + len("-rank-") : -len(".pt")]
        state = torch.load(path, weights_only=False)
        torch.save({k: state[k] for k in ("model", *head)}, f"{prefix}_consolidated-rank-{rank}.pt")
        path.rename(directory / f"{name}-rank-{rank}-shard{rank}.pt")
    return prefix
