"""The checkpoint tool's ``merge``, ``reshard`` and ``inspect`` subcommands (rows of fairseq_moe_ext/console.py's
registry), and what every subcommand of the tool shares: its shared arguments checked before any work and a refusal
printed as one ``error:`` line with exit status 2 (``refusing``), an output name that must be free
(``refuse_overwrite``), a whole checkpoint written as one file (``write_merged``) and a set's expert-parallel size
(``expert_parallel_size``)."""

import functools
import glob
import os
import sys

import torch

from ..common.config_value import config_value
from ..common.refusal import MoERefusal
from ..moe.expert_layout import default_expert_parallel_size, divides_layout, valid_parallel_sizes
from ..options.ranges import CHECKPOINT_TOOL_RANGES, check_options
from .contents import experts_held
from .errors import CheckpointSetError
from .inspection import inspect_checkpoint
from .names import base_of, manifest_path
from .reshard import experts_per_key, load_full, save_set
from .staging import check_output_directory, write_all_or_nothing


def refusing(run):
    """``run(args)`` once what every subcommand shares is checked (``check_shared_arguments``), with every refusal
    of the plugin (a checkpoint's, an option's range) printed as one ``error:`` line on stderr and exit status 2."""

    @functools.wraps(run)
    def refused_in_one_line(args) -> int:
        try:
            check_shared_arguments(args)
            return run(args)
        except MoERefusal as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return refused_in_one_line


def check_shared_arguments(args) -> None:
    """Before any work: --world-size and --expert-parallel-size within their ranges, and an output (``output``, or
    export-hf's ``output_dir``) that can be written (a missing or read-only directory, a full filesystem: refused
    now, not once a set that can take minutes to load was read)."""
    check_options(CHECKPOINT_TOOL_RANGES, lambda name: config_value(args, name))
    output_dir, output = config_value(args, "output_dir"), config_value(args, "output")
    if output_dir is not None:  # a new (or empty) directory: its parent must take it
        where = output_dir if os.path.isdir(output_dir) else os.path.dirname(output_dir)
        check_output_directory(where, f"the Hugging Face checkpoint {output_dir}")
    elif output is not None:
        check_output_directory(os.path.dirname(output), output)


def add_merge_parser(p) -> None:
    p.add_argument("checkpoint", help="e.g. save_dir/checkpoint_best.pt (rank suffix not needed)")
    p.add_argument("output", help="the .pt file to write")


@refusing
def merge_command(args) -> int:
    refuse_overwrite(args.output)
    print(f"wrote {write_merged(load_full(args.checkpoint), args.output)}")
    return 0


def add_reshard_parser(p) -> None:
    p.add_argument("checkpoint")
    p.add_argument("output", help="output name, e.g. new_dir/checkpoint_best.pt")
    p.add_argument("--world-size", type=int, required=True, help="the workers that will resume from the set (W)")
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=None,
        help="P: the set's rank files (expert shards); W / P workers hold replicas of each (default: the "
        "largest P dividing both W and the expert count, as fairseq-train's default)",
    )


@refusing
def reshard_command(args) -> int:
    # Everything that can be checked before loading is checked before loading.
    refuse_overwrite(args.output)
    check_world_size(args.world_size)
    full = load_full(args.checkpoint)
    write_set(full, args)
    return 0


def add_inspect_parser(p) -> None:
    p.add_argument("checkpoint")


@refusing
def inspect_command(args) -> int:
    lines = inspect_checkpoint(args.checkpoint)
    print("\n".join(lines))
    return 1 if any(line.startswith("VERDICT PROBLEM") for line in lines) else 0


def check_world_size(workers: int) -> None:
    if workers < 1:
        raise CheckpointSetError(
            f"--world-size must be a positive number of workers, got {workers}: use the number of "
            f"workers that will resume from the set"
        )


def write_set(full, args) -> None:
    """``full`` as a set of ``args.world_size`` workers' rank files named ``args.output``, the output line printed."""
    shards = expert_parallel_size(full, args.world_size, config_value(args, "expert_parallel_size"))
    print(f"wrote {save_set(full, base_of(args.output), shards, workers=args.world_size)}")


def expert_parallel_size(full, workers: int, given) -> int:
    """P for a set that ``workers`` workers resume: the one given, or gcd(W, E) (every layer's E, where the
    encoder and decoder hold different numbers); P must divide both."""
    counts = sorted(set(experts_per_key(full).values())) or [1]
    if given is None:
        return default_expert_parallel_size(workers, *counts)
    if not divides_layout(given, workers, *counts):
        experts = " and ".join(map(str, counts))
        choices = valid_parallel_sizes(workers, *counts)
        raise CheckpointSetError(
            f"--expert-parallel-size {given} must divide both --world-size {workers} and the {experts} experts: use "
            f"one of {choices}"
        )
    return given


def write_merged(full, output) -> str:
    """One ordinary single-file checkpoint (a whole: no set id, every expert held)."""
    meta = {k: v for k, v in full["moe"].items() if k != "set_id"}
    total = max([int(full["model"][k].shape[0]) for k in meta["expert_keys"] if k in full["model"]], default=0)
    full["moe"] = dict(meta, world_size=1, rank=0, experts_held=experts_held(0, total))
    name = os.path.basename(output)

    def write(staging_dir):
        torch.save(full, os.path.join(staging_dir, name))
        return [name]

    write_all_or_nothing(os.path.dirname(output), output, write)
    return output


def refuse_overwrite(output):
    """An output name is taken if any layout of it exists: the file itself, a single file, a set's
    manifest or any rank file (writing beside them would leave two layouts for one name)."""
    base = base_of(output)
    taken = [p for p in (output, base + ".pt", manifest_path(base)) if os.path.exists(p)]
    taken += sorted(glob.glob(glob.escape(base) + "-rank-*-of-*.pt"))
    if taken:
        raise CheckpointSetError(f"{taken[0]} exists; choose another output name (nothing was overwritten)")
