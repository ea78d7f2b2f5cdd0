"""``python -m fairseq_moe_ext.checkpoint merge|reshard|inspect|upcycle|prune|import-fairseq-moe|export-hf|import-hf``.

The CLI lives apart from the library so that ``-m`` runs a module the package has not imported
yet (fairseq's ``--user-dir`` import loads the library through ``fairseq_integration``).
"""

import argparse
import glob
import os
import sys

import torch

from ..common.config_value import config_value
from ..common.refusal import MoERefusal
from ..moe.expert_layout import default_expert_parallel_size
from ..options.ranges import CHECKPOINT_TOOL_RANGES, check_options
from .branch.importer import import_branch_set
from .contents import experts_held
from .errors import CheckpointSetError
from .hf.dtype import cast_dtype
from .hf.exporter import export_hf, shard_size
from .hf.importer import import_hf
from .inspection import inspect_checkpoint
from .names import base_of, manifest_path
from .prune_cli import add_prune_parser, prune_command
from .reshard import experts_per_key, load_full, save_set
from .staging import check_output_directory, write_all_or_nothing


def main(argv=None) -> int:
    # The one import of checkpoint/ from a tier above: upcycling is fairseq-train's business
    # (training/), and training/upcycle_cli.py imports fairseq only when the subcommand runs.
    from ..training.upcycle_cli import add_upcycle_parser, upcycle

    parser = argparse.ArgumentParser(
        prog="python -m fairseq_moe_ext.checkpoint",
        description="Merge, reshard and inspect fairseq-moe-ext checkpoints (sets of per-rank files or single files), "
        "and upcycle dense fairseq checkpoints into MoE ones.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("merge", help="write one ordinary single-file checkpoint holding every expert")
    p.add_argument("checkpoint", help="e.g. save_dir/checkpoint_best.pt (rank suffix not needed)")
    p.add_argument("output", help="the .pt file to write")
    p = sub.add_parser("reshard", help="write the checkpoint as a set of W rank files")
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
    p = sub.add_parser("inspect", help="describe a set or file and check its consistency")
    p.add_argument("checkpoint")
    add_upcycle_parser(sub)
    p = sub.add_parser(
        "import-fairseq-moe",
        help="import a fairseq moe/nllb-branch set (<prefix>-shared.pt and "
        "<prefix>-rank-N.pt, e.g. NLLB-200 MoE) as this project's checkpoint",
    )
    p.add_argument("prefix", help="e.g. nllb/checkpoint_2_300000 for checkpoint_2_300000-{shared,rank-0,...}.pt")
    p.add_argument(
        "output", help="output name, e.g. moe/checkpoint_imported.pt (a set of rank files if --world-size > 1)"
    )
    p.add_argument("--world-size", type=int, default=1, help="W: write a set for W workers (1, the default: one file)")
    p.add_argument(
        "--dictionary",
        default=None,
        help="the dict.txt you will generate with: checked against the embedding's rows, with --langs",
    )
    p.add_argument(
        "--langs",
        default=None,
        help="the model's languages, in order (a comma list or a file); default: what the set records",
    )
    p = sub.add_parser(
        "export-hf",
        help="write a translation set as a Hugging Face NLLB-MoE checkpoint directory "
        "(config.json, safetensors shards and their index)",
    )
    p.add_argument("checkpoint", help="the set, e.g. save_dir/checkpoint_best.pt (rank suffix not needed)")
    p.add_argument("output_dir", help="a new (or empty) directory for config.json and the shards")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB (default 2GB)")
    p.add_argument(
        "--training-as-nllb",
        action="store_true",
        help="export a set trained with options that act in training only and NllbMoe lacks (a capacity "
        "factor other than 1, gate noise): NllbMoe's own training settings are written, with a NOTE; "
        "evaluation is unchanged",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="cast every tensor to float32, float16 or bfloat16 as it is written (config.json's torch_dtype says "
        "so); default: the set's own dtype",
    )
    p = sub.add_parser(
        "import-hf", help="import a Hugging Face NLLB-MoE checkpoint directory as this project's checkpoint"
    )
    p.add_argument("hf_dir", help="the directory holding config.json and the safetensors file(s)")
    p.add_argument(
        "output", help="output name, e.g. moe/checkpoint_imported.pt (a set of rank files if --world-size > 1)"
    )
    p.add_argument("--world-size", type=int, default=1, help="W: write a set for W workers (1, the default: one file)")
    p.add_argument(
        "--dtype",
        default=None,
        help="cast every tensor to float32, float16 or bfloat16; default: keep the dtype the Hugging Face files hold",
    )
    add_prune_parser(sub)
    args = parser.parse_args(argv)
    try:
        check_options(CHECKPOINT_TOOL_RANGES, lambda name: getattr(args, name, None))
        # Every output is checked before the work that fills it (loading a set can take minutes).
        if args.command == "export-hf":
            out = args.output_dir
            check_output_directory(
                out if os.path.isdir(out) else os.path.dirname(out), f"the Hugging Face checkpoint {out}"
            )
        elif args.command != "inspect":
            _refuse_overwrite(args.output)
            check_output_directory(os.path.dirname(args.output), args.output)
        if args.command == "prune":
            return prune_command(args)
        if args.command == "export-hf":
            export_hf(
                args.checkpoint,
                args.output_dir,
                shard_size(args.max_shard_size),
                training_as_nllb=args.training_as_nllb,
                dtype=cast_dtype(args.dtype, "export-hf"),
            )
            return 0
        if args.command == "import-hf":
            import_hf(args.hf_dir, args.output, args.world_size, dtype=cast_dtype(args.dtype, "import-hf"))
            return 0
        if args.command == "import-fairseq-moe":
            import_branch_set(args.prefix, args.output, args.world_size, dictionary=args.dictionary, langs=args.langs)
            return 0
        if args.command == "inspect":
            lines = inspect_checkpoint(args.checkpoint)
            print("\n".join(lines))
            return 1 if any(line.startswith("VERDICT PROBLEM") for line in lines) else 0
        if args.command == "upcycle":
            full = upcycle(args)
            if args.world_size == 1:
                print(f"wrote {write_merged(full, args.output)}")
                return 0
        else:
            full = load_full(args.checkpoint)
        if args.command == "merge":
            print(f"wrote {write_merged(full, args.output)}")
        else:
            shards = expert_parallel_size(full, args.world_size, config_value(args, "expert_parallel_size"))
            print(f"wrote {save_set(full, base_of(args.output), shards, workers=args.world_size)}")
        return 0
    except MoERefusal as e:  # a checkpoint's, an option's range
        print(f"error: {e}", file=sys.stderr)
        return 2


def expert_parallel_size(full, workers: int, given) -> int:
    """P for a set that ``workers`` workers resume: the one given, or gcd(W, E) (every layer's E, where the
    encoder and decoder hold different numbers); P must divide both."""
    counts = sorted(set(experts_per_key(full).values())) or [1]
    if given is None:
        return default_expert_parallel_size(workers, *counts)
    if given < 1 or workers % given or any(e % given for e in counts):
        experts = " and ".join(map(str, counts))
        choices = [p for p in range(1, workers + 1) if workers % p == 0 and all(e % p == 0 for e in counts)]
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


def _refuse_overwrite(output):
    """An output name is taken if any layout of it exists: the file itself, a single file, a set's
    manifest or any rank file (writing beside them would leave two layouts for one name)."""
    base = base_of(output)
    taken = [p for p in (output, base + ".pt", manifest_path(base)) if os.path.exists(p)]
    taken += sorted(glob.glob(glob.escape(base) + "-rank-*-of-*.pt"))
    if taken:
        raise CheckpointSetError(f"{taken[0]} exists; choose another output name (nothing was overwritten)")


if __name__ == "__main__":
    sys.exit(main())
