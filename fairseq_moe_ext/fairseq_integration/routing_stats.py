"""``--moe-routing-stats FILE`` for fairseq-generate and fairseq-validate: which experts each group of
sentences (a language, a domain) uses, counted over real tokens only, written as the JSON that
``fairseq-moe prune`` reads (schema: moe/routing_stats.py, docs/routing.md).

Where fairseq meets it: the command line is read when it is parsed (``decide_routing_stats``, from the
parse_args_and_arch hook), the model's MoE layers get a tally and its encoder a row tracker when it is
loaded (``attach``, from the load_model_ensemble_and_task hook), and the progress-bar hook hands each
batch to the tracker and writes the file when the batches run out (every worker's counts summed, in
expert-sharded inference). A token's key is its sentence's: the line of ``--moe-routing-stats-groups``
for its sentence id, or else the task's source language on the encoder side and target language on
the decoder side. In generation the decoder's rows follow the beam search through the encoder's
``reorder_encoder_out``, so every hypothesis token counts under its own sentence's key.
"""

import functools
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import checkpoint as moe_ckpt
from ..checkpoint.staging import check_output_file, write_all_or_nothing
from ..common.config_value import config_value
from ..common.input_file import check_line_count, read_lines
from ..common.refusal import MoEOptionError
from ..moe import MoELayer
from ..moe.routing_stats import RoutingTally, holds_statistics, statistics_document, statistics_json
from ..options import moe_options

GROUPS = "--moe-routing-stats-groups"
GROUPS_HOLD = "one key per line of the subset, in the order of its sentence ids"


# fmt: off
@dataclass
class RoutingStatsRun:
    """This process's --moe-routing-stats: where to write, the keys per sentence id, and the counts so far."""

    output: str
    path: str  # the --path counted
    keys: Optional[List[str]]  # per sentence id (--moe-routing-stats-groups), or None
    grouped_by: str
    encoder_key: str
    decoder_key: str
    subset: Optional[str]
    tool: str
    tally: RoutingTally = field(default_factory=RoutingTally)
    names: List[str] = field(default_factory=list)  # group key by index
    rows: dict = field(default_factory=dict)  # side -> LongTensor: each batch row's group index
    model: Optional[dict] = None  # the model's identity (statistics_document's "model")
    groups_file: Optional[str] = None  # --moe-routing-stats-groups, whose lines are checked against the subset
    task: Optional[object] = None  # the task the subset is read with (attach)
# fmt: on


def decide_routing_stats(args) -> Optional[RoutingStatsRun]:
    """At parse time: the run --moe-routing-stats asks for (None without it), or its refusal in one line."""
    output = moe_options(args).moe_routing_stats
    groups = moe_options(args).moe_routing_stats_groups
    if output is None:
        if groups is not None:
            raise MoEOptionError(
                "--moe-routing-stats-groups needs --moe-routing-stats FILE: add it, or drop the groups"
            )
        return None
    tool = os.path.basename(sys.argv[0]) or "python"
    if not config_value(args, "path") or config_value(args, "input") is not None:
        raise MoEOptionError(
            "--moe-routing-stats counts the sentences of a subset: use it with fairseq-generate or fairseq-validate"
        )
    # Checked before any work (loading the model, generating): what writing the file would meet at the end.
    check_output_file(output, f"--moe-routing-stats {output}")
    if os.path.isfile(output) and not holds_statistics(output):  # a checkpoint, a groups file named by mistake
        raise MoEOptionError(
            f"--moe-routing-stats {output} exists and holds no routing statistics, which the file would replace: "
            f"choose a new file name (nothing was written)"
        )
    # fairseq-validate counts every subset of --valid-subset, the other tools --gen-subset (each tool's
    # namespace holds both flags).
    subset = str(config_value(args, "valid_subset" if "validate" in tool else "gen_subset"))
    keys = None
    if groups is not None:
        if "," in subset:
            raise MoEOptionError(
                f"{GROUPS} labels the sentences of one subset by their ids, and --valid-subset {subset} names "
                f"{subset.count(',') + 1}, whose ids overlap: count each subset in a run of its own"
            )
        keys = [line.strip() for line in read_lines(groups, GROUPS, GROUPS_HOLD)]
        empty = next((i for i, k in enumerate(keys, 1) if not k), None) if keys else 1
        if empty is not None:
            raise MoEOptionError(
                f"{GROUPS} {groups}: line {empty} holds no key (every line must hold one); give {GROUPS_HOLD}"
            )
    source, target = config_value(args, "source_lang"), config_value(args, "target_lang")
    return RoutingStatsRun(
        output=output,
        path=str(config_value(args, "path")).split(os.pathsep)[0],
        keys=keys,
        grouped_by=f"file {os.path.abspath(groups)}" if keys is not None else "language pair" if source else "all",
        encoder_key=str(source or "all"),
        decoder_key=str(target or "all"),
        subset=subset,
        tool=tool,
        groups_file=groups,
    )


def group_index(run: RoutingStatsRun, key: str) -> int:
    if key not in run.names:
        run.names.append(key)
    return run.names.index(key)


def attach(run: RoutingStatsRun, model, task=None) -> None:
    """Give ``model``'s MoE layers the run's tally, and its encoder the rows the decoder follows; the
    language pair is read off the set-up ``task`` (translation infers it from the data directory)."""
    run.task = task
    for holder in (getattr(task, "cfg", None), getattr(task, "args", None)):
        source, target = config_value(holder, "source_lang"), config_value(holder, "target_lang")
        if run.keys is None and source and target:
            run.encoder_key, run.decoder_key, run.grouped_by = str(source), str(target), "language pair"
            break
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
    run.model = dict(
        identity(run.path), layers={name: m.num_experts for name, m in named}, top_k=named[0][1].k if named else None
    )
    for name, layer in named:
        layer.routing_tally = functools.partial(count, run, name)
    encoder = getattr(model, "encoder", None)
    if encoder is not None and hasattr(encoder, "reorder_encoder_out"):
        encoder.reorder_encoder_out = reordered(encoder.reorder_encoder_out, run)


def identity(path: str) -> dict:
    """The set id and update of the checkpoint counted (None where a single file records no set id)."""
    manifest = moe_ckpt.manifest_path(moe_ckpt.base_of(path))
    if os.path.isfile(manifest):
        found = moe_ckpt.read_manifest(manifest)
        return {"set_id": found.get("set_id"), "num_updates": found["num_updates"]}
    meta = moe_ckpt.peek_metadata(path) or {}
    return {"set_id": meta.get("set_id"), "num_updates": meta.get("num_updates")}


def reordered(reorder, run: RoutingStatsRun):
    @functools.wraps(reorder)
    def reorder_encoder_out(encoder_out, new_order):
        if "decoder" in run.rows:
            run.rows["decoder"] = run.rows["decoder"][new_order.cpu()]
        return reorder(encoder_out, new_order)

    return reorder_encoder_out


def start_batch(run: RoutingStatsRun, sample) -> None:
    """The group index of each row of ``sample``, for both sides (the decoder's then follow reorders)."""
    if not isinstance(sample, dict) or "net_input" not in sample:
        run.rows = {}
        return
    ids = sample["id"].tolist()
    if run.keys is not None:
        if run.task is not None and run.groups_file is not None:  # once, before the first batch is counted
            sentences = len(run.task.dataset(run.subset))
            check_line_count(
                run.keys, sentences, run.groups_file, GROUPS, f"the sentences of {run.subset}", GROUPS_HOLD
            )
            run.groups_file = None
        if max(ids, default=-1) >= len(run.keys):  # no task to ask (not a fairseq tool's load)
            raise MoEOptionError(
                f"{GROUPS} has {len(run.keys)} lines, but the subset has sentence id {max(ids)}: give {GROUPS_HOLD}"
            )
        encoder = decoder = [group_index(run, run.keys[i]) for i in ids]
    else:
        encoder = [group_index(run, run.encoder_key)] * len(ids)
        decoder = [group_index(run, run.decoder_key)] * len(ids)
    run.rows = {"encoder": torch.tensor(encoder, dtype=torch.long), "decoder": torch.tensor(decoder, dtype=torch.long)}


def count(run: RoutingStatsRun, name: str, layer, expert_index, gates) -> None:
    if expert_index.shape[0] == 0:  # a lock-step mirror call, or an empty batch
        return
    side = "encoder" if name.startswith("encoder.") else "decoder"
    rows = run.rows.get(side)
    shape, batch_major = getattr(layer, "token_shape", None) or ((expert_index.shape[0],), False)
    if rows is None or len(shape) != 2:
        raise MoEOptionError(
            f"--moe-routing-stats: MoE layer {name} ran outside a batch of the evaluated subset, so its "
            f"tokens have no key; count with fairseq-generate or fairseq-validate"
        )
    batch = shape[0] if batch_major else shape[1]
    steps = shape[1] if batch_major else shape[0]
    if batch != rows.shape[0]:
        raise MoEOptionError(
            f"--moe-routing-stats: MoE layer {name} saw {batch} sentences where the batch has "
            f"{rows.shape[0]}; this generation path is not supported by the routing statistics"
        )
    token_group = rows.repeat_interleave(steps) if batch_major else rows.repeat(steps)
    run.tally.add(name, layer.num_experts, expert_index, gates, token_group, list(run.names))


def finish(run: RoutingStatsRun, group=None) -> None:
    """Sum every worker's counts (``group``: the expert-sharded run's) and write the file on rank 0."""
    tally = run.tally
    rank = 0
    if group is not None:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, run.tally, group=group)
        rank = dist.get_rank(group)
        tally = RoutingTally()
        for other in gathered:
            tally.merge(other)
    if rank == 0:
        source = {"tool": run.tool, "path": run.path, "subset": run.subset}
        text = statistics_json(statistics_document(tally, run.model, run.grouped_by, source))
        name = os.path.basename(run.output)

        def write(staging: str):
            with open(os.path.join(staging, name), "w") as f:
                f.write(text)
            return [name]

        # The checkpoints' staging: the file appears whole or not at all, nothing half-written is left.
        write_all_or_nothing(os.path.dirname(run.output), f"--moe-routing-stats {run.output}", write, replace=True)
