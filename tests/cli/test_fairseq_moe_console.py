"""``fairseq-moe``, the console script setup.py installs: every row of its registry (console.COMMANDS) is reachable
under each of its three spellings (the script, ``python -m fairseq_moe_ext``, ``python -m
fairseq_moe_ext.checkpoint``), usage and error lines name the spelling typed, and the installed script's output is
its aliases' byte for byte. In process through each spelling's ``main(argv)``; the installed script itself in the
slow tests."""

import os
import subprocess
import sys

import pytest

import fairseq_moe_ext
from fairseq_moe_ext import __main__ as module_alias
from fairseq_moe_ext import console
from fairseq_moe_ext.checkpoint import __main__ as checkpoint_alias
from support.inputs.fake_checkpoints import full_state
from support.launch.fairseq_helpers import CHECKPOINT_TOOL, FAIRSEQ_MOE, run_checkpoint_tool

# (the prog its usage and error lines show, its main)
SPELLINGS = {
    "fairseq-moe": console.main,
    "python -m fairseq_moe_ext": module_alias.main,
    "python -m fairseq_moe_ext.checkpoint": checkpoint_alias.main,
}


@pytest.fixture(autouse=True)
def wide_help(monkeypatch):
    """argparse wraps help at the terminal's width (and splits words at hyphens): one line per entry here."""
    monkeypatch.setenv("COLUMNS", "1000")


def exited(capsys, main, *argv):
    """(exit status, stdout, stderr's lines) of ``main(argv)``, whether it returned or argparse exited."""
    try:
        code = main(list(argv))
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


@pytest.mark.parametrize("command", console.COMMANDS, ids=lambda c: c.name)
@pytest.mark.parametrize("prog", SPELLINGS)
def test_every_subcommand_answers_help_naming_itself_through_the_script_and_both_aliases(capsys, prog, command):
    code, out, err = exited(capsys, SPELLINGS[prog], command.name, "--help")
    assert (code, err) == (0, []), err
    assert out.startswith(f"usage: {prog} {command.name} "), out
    assert command.help in out


@pytest.mark.parametrize("prog", SPELLINGS)
def test_the_listing_names_every_subcommand_with_its_help_under_each_spelling(capsys, prog):
    code, out, _ = exited(capsys, SPELLINGS[prog], "--help")
    assert code == 0 and out.startswith(f"usage: {prog} [-h] [--user-dir] <subcommand> ...")
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and line[4] != " "]
    assert listed == [command.name for command in console.COMMANDS]
    words = " ".join(out.split())
    assert all(f" {command.name} {command.help} " in words for command in console.COMMANDS), out


@pytest.mark.parametrize("prog", SPELLINGS)
@pytest.mark.parametrize("argv", [["--user-dir"], ["user-dir"]], ids=["flag", "subcommand"])
def test_user_dir_as_flag_or_subcommand_prints_the_plugin_directory_under_each_spelling(capsys, prog, argv):
    assert exited(capsys, SPELLINGS[prog], *argv) == (0, fairseq_moe_ext.PACKAGE_DIR + "\n", [])


# fmt: off
BAD_COMMAND_LINES = [
    (["reshard", "in.pt", "out.pt"], "{prog} reshard: error: the following arguments are required: --world-size"),
    (["prune", "in.pt", "out.pt", "--stats", "s.json"],
     "{prog} prune: error: one of the arguments --keep --keep-fraction is required"),
    (["plan", "--world-size", "eight"], "{prog} plan: error: argument --world-size: invalid int value: 'eight'"),
    (["mrege", "in.pt"], "{prog}: error: argument <subcommand>: invalid choice: 'mrege' (choose from 'plan', "),
    ([], "{prog}: error: no subcommand given: use one of plan, merge, reshard, inspect, upcycle, prune, "),
]
# fmt: on


@pytest.mark.parametrize("prog", SPELLINGS)
@pytest.mark.parametrize(
    "argv, line", BAD_COMMAND_LINES, ids=[" ".join(argv[:1]) or "none" for argv, _ in BAD_COMMAND_LINES]
)
def test_a_bad_command_line_is_one_error_line_naming_spelling_and_subcommand_exit_2(capsys, prog, argv, line):
    code, out, err = exited(capsys, SPELLINGS[prog], *argv)
    assert code == 2 and out == "", out
    assert err[0].startswith(f"usage: {prog}") and err[-1].startswith(line.format(prog=prog)), err
    assert [row for row in err if ": error: " in row] == [err[-1]], err


@pytest.mark.parametrize("prog", SPELLINGS)
def test_a_refused_checkpoint_is_the_same_error_line_and_status_under_each_spelling(tmp_path, capsys, prog):
    code, out, err = exited(capsys, SPELLINGS[prog], "merge", tmp_path / "absent.pt", tmp_path / "out.pt")
    assert (code, out) == (2, "")
    assert err == [f"error: no checkpoint named {tmp_path / 'absent.pt'} (neither a file nor a set manifest "
                   f"{tmp_path / 'absent.set.json'})"]  # fmt: skip
    assert os.listdir(tmp_path) == []


def test_the_listing_and_user_dir_import_neither_torch_nor_fairseq_nor_a_subcommand():
    """The registry imports a row's module only to run it: the listing stays fast where fairseq is not there."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import contextlib, io, sys\n"
            "from fairseq_moe_ext.console import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            "        main(['--help'])\n"
            "    except SystemExit as exit:\n"
            "        assert exit.code == 0\n"
            "    assert main(['--user-dir']) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fairseq') or '_cli' in m))\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(fairseq_moe_ext.PACKAGE_DIR)),
    )
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


@pytest.mark.slow
def test_the_installed_script_inspects_and_refuses_as_the_checkpoint_alias_does(tmp_path):
    assert os.path.exists(FAIRSEQ_MOE), f"{FAIRSEQ_MOE} is missing: pip install -e . installs it (setup.py)"
    from fairseq_moe_ext import checkpoint as moe_ckpt

    moe_ckpt.save_set(full_state(), str(tmp_path / "checkpoint_last"), 2)
    script, alias = (run_checkpoint_tool("inspect", tmp_path / "checkpoint_last.pt", program=p)
                     for p in (FAIRSEQ_MOE, CHECKPOINT_TOOL))  # fmt: skip
    assert script.returncode == alias.returncode == 0, script.stderr + alias.stderr
    assert script.stdout == alias.stdout and "2 rank files" in script.stdout, script.stdout
    refused = run_checkpoint_tool("reshard", tmp_path / "checkpoint_last.pt", tmp_path / "new.pt", program=FAIRSEQ_MOE)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines()[-1] == (
        "fairseq-moe reshard: error: the following arguments are required: --world-size"
    )


@pytest.mark.slow
def test_the_installed_script_plans_a_tiny_model_byte_for_byte_as_the_module_alias(tmp_path):
    # fmt: off
    argv = ["plan", tmp_path / "absent", "--task", "translation", "-s", "src", "-t", "tgt", "--arch",
            "moe_transformer_tiny", "--optimizer", "adam", "--max-tokens", "64", "--cpu", "--dictionary-size", "30",
            "--world-size", "2"]
    # fmt: on
    script, alias = (run_checkpoint_tool(*argv, program=p) for p in (FAIRSEQ_MOE, "fairseq_moe_ext"))
    assert script.returncode == alias.returncode == 0, script.stderr + alias.stderr
    assert script.stdout == alias.stdout and "W = 2" in script.stdout.splitlines()[0], script.stdout
