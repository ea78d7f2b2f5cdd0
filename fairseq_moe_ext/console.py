"""``fairseq-moe <subcommand>``: every tool the plugin ships, on one command line, installed by setup.py
beside fairseq's own ``fairseq-*`` scripts. ``python -m fairseq_moe_ext`` and ``python -m
fairseq_moe_ext.checkpoint`` are the same command under another name (each passes its spelling as ``prog``,
which usage and error lines show).

``COMMANDS`` is the registry, one row per subcommand: its name, its one-line help, the function adding its
arguments to its parser and the one running it. A row's module is imported only when its subcommand is the
one asked for, so ``fairseq-moe --help`` imports neither torch nor fairseq. ``plan`` takes fairseq-train's
arguments: its run is handed the command line after its name as it was typed, and its parser only answers
``--help``.
"""

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Optional

from . import PACKAGE_DIR

HELP_FLAGS = ("-h", "--help")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str  # under fairseq_moe_ext, imported when the subcommand runs
    add_parser: Optional[str]  # module's function(parser) adding the subcommand's arguments; None: it takes none
    run: str  # module's function(args) -> exit status; with ``raw``, function(argv after the name, prog)
    raw: bool = False

    def function(self, which: str):
        return getattr(importlib.import_module(f"{__package__}.{self.module}"), getattr(self, which))


# fmt: off
COMMANDS = (
    Command("plan", "per-worker memory for every backend and expert-parallel size, from fairseq-train's arguments "
            "(the model built on the meta device)", "training.plan_cli", "add_plan_parser", "main", raw=True),
    Command("merge", "write one ordinary single-file checkpoint holding every expert",
            "checkpoint.sets_cli", "add_merge_parser", "merge_command"),
    Command("reshard", "write the checkpoint as a set of W rank files",
            "checkpoint.sets_cli", "add_reshard_parser", "reshard_command"),
    Command("inspect", "describe a set or file and check its consistency",
            "checkpoint.sets_cli", "add_inspect_parser", "inspect_command"),
    Command("upcycle", "turn a dense fairseq checkpoint into an MoE one that computes the same function (sparse "
            "upcycling: every expert a copy of the dense FFN)", "training.upcycle_cli", "add_upcycle_parser",
            "upcycle_command"),
    Command("prune", "keep the experts routing statistics rank highest (per language or domain) and write a "
            "smaller set", "checkpoint.prune_cli", "add_prune_parser", "prune_command"),
    Command("import-fairseq-moe", "import a fairseq moe/nllb-branch set (<prefix>-shared.pt and <prefix>-rank-N.pt, "
            "e.g. NLLB-200 MoE) as this project's checkpoint", "checkpoint.exchange_cli",
            "add_import_fairseq_moe_parser", "import_fairseq_moe_command"),
    Command("export-hf", "write a translation set as a Hugging Face NLLB-MoE checkpoint directory (config.json, "
            "safetensors shards and their index)", "checkpoint.exchange_cli", "add_export_hf_parser",
            "export_hf_command"),
    Command("import-hf", "import a Hugging Face NLLB-MoE checkpoint directory as this project's checkpoint",
            "checkpoint.exchange_cli", "add_import_hf_parser", "import_hf_command"),
    Command("user-dir", "print the directory to pass to fairseq's --user-dir", "console", None, "user_dir_command"),
)
# fmt: on
BY_NAME = {command.name: command for command in COMMANDS}


def user_dir_command(args) -> int:
    print(PACKAGE_DIR)
    return 0


def listing(prog: str) -> argparse.ArgumentParser:
    """The parser of ``prog`` itself: its --help lists every subcommand with its help."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Mixture-of-Experts training for stock fairseq (fairseq-moe-ext): its tools. "
        f"'{prog} <subcommand> --help' describes a subcommand's arguments.",
        epilog="'fairseq-moe', 'python -m fairseq_moe_ext' and 'python -m fairseq_moe_ext.checkpoint' are the "
        "same command.",
    )
    parser.add_argument("--user-dir", action="store_true", help="the same as the user-dir subcommand")
    sub = parser.add_subparsers(title="subcommands", dest="command", metavar="<subcommand>")
    for command in COMMANDS:
        sub.add_parser(command.name, help=command.help, add_help=False)
    return parser


def main(argv=None, prog: str = "fairseq-moe") -> int:
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    if argv[:1] == ["--user-dir"]:
        argv[0] = "user-dir"
    command = BY_NAME.get(argv[0]) if argv else None
    if command is None:
        parser = listing(prog)
        parser.parse_args(argv)  # --help: the listing, exit 0; an unknown subcommand: one error line, exit 2
        parser.error(f"no subcommand given: use one of {', '.join(BY_NAME)} ('{prog} --help' says what each does)")
    name, rest = argv[0], argv[1:]
    if command.raw and not any(arg in HELP_FLAGS for arg in rest):
        return command.function("run")(rest, f"{prog} {name}")
    parser = argparse.ArgumentParser(prog=f"{prog} {name}", description=command.help)
    if command.add_parser is not None:
        command.function("add_parser")(parser)
    return command.function("run")(parser.parse_args(rest))
