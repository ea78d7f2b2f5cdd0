"""The checkpoint tool's imports and exports (rows of fairseq_moe_ext/console.py's registry): ``import-fairseq-moe``
(a moe/nllb-branch set in: branch/), ``export-hf`` and ``import-hf`` (Hugging Face NLLB-MoE out and in: hf/)."""

from .branch.importer import import_branch_set
from .hf.dtype import cast_dtype
from .hf.exporter import export_hf, shard_size
from .hf.importer import import_hf
from .sets_cli import refuse_overwrite, refusing


def add_set_output(p) -> None:
    """The output both imports write: one file, or a set of rank files for --world-size W."""
    p.add_argument(
        "output", help="output name, e.g. moe/checkpoint_imported.pt (a set of rank files if --world-size > 1)"
    )
    p.add_argument("--world-size", type=int, default=1, help="W: write a set for W workers (1, the default: one file)")


def add_import_fairseq_moe_parser(p) -> None:
    p.add_argument("prefix", help="e.g. nllb/checkpoint_2_300000 for checkpoint_2_300000-{shared,rank-0,...}.pt")
    add_set_output(p)
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


@refusing
def import_fairseq_moe_command(args) -> int:
    refuse_overwrite(args.output)
    import_branch_set(args.prefix, args.output, args.world_size, dictionary=args.dictionary, langs=args.langs)
    return 0


def add_export_hf_parser(p) -> None:
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


@refusing
def export_hf_command(args) -> int:
    export_hf(
        args.checkpoint,
        args.output_dir,
        shard_size(args.max_shard_size),
        training_as_nllb=args.training_as_nllb,
        dtype=cast_dtype(args.dtype, "export-hf"),
    )
    return 0


def add_import_hf_parser(p) -> None:
    p.add_argument("hf_dir", help="the directory holding config.json and the safetensors file(s)")
    add_set_output(p)
    p.add_argument(
        "--dtype",
        default=None,
        help="cast every tensor to float32, float16 or bfloat16; default: keep the dtype the Hugging Face files hold",
    )


@refusing
def import_hf_command(args) -> int:
    refuse_overwrite(args.output)
    import_hf(args.hf_dir, args.output, args.world_size, dtype=cast_dtype(args.dtype, "import-hf"))
    return 0
