"""Every loader of a user's checkpoint file refuses a pickle that would run a shell command, in one line,
and never runs it (the command would create a marker file): the checkpoint tool's merge, reshard,
inspect and upcycle, on a set (a forged rank file, its manifest entry updated to match) and on a single
file, and both imports, in process. fairseq's loader (training, generation, the hub interface):
tests/fairseq/test_untrusted_pickles_fairseq.py and tests/cli/test_bad_input_pickles.py. With
``WEIGHTS_ONLY = False`` in checkpoint/safe_load.py every test here fails except import-hf's (it reads
safetensors only and never opens a pickle)."""

import json

import pytest
import torch

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint import __main__ as tool
from fairseq_moe_ext.checkpoint.hf.fields import REQUIRED_INTEGERS
from support.inputs.fake_checkpoints import full_state
from support.inputs.untrusted_pickles import MARKER, REFUSED, plant, plant_in_set

RANK_1 = "checkpoint_last-rank-1-of-2.pt"


def run_tool(capsys, *argv):
    code = tool.main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def forged(tmp_path, layout):
    """``in/checkpoint_last.pt``: a 2-worker set with rank 1's file forged, or a single file."""
    source = tmp_path / "in"
    source.mkdir()
    if layout == "set":
        moe_ckpt.save_set(full_state(), str(source / "checkpoint_last"), 2)
        plant_in_set(source, RANK_1, tmp_path / MARKER)
    else:
        plant(source / "checkpoint_last.pt", tmp_path / MARKER, state=full_state())
    (tmp_path / "out").mkdir()
    return source / "checkpoint_last.pt"


COMMANDS = {
    "merge": lambda out: ["merge", "{src}", out / "merged.pt"],
    "reshard": lambda out: ["reshard", "{src}", out / "resharded.pt", "--world-size", "2"],
    "inspect": lambda out: ["inspect", "{src}"],
    "upcycle": lambda out: ["upcycle", "{src}", out / "upcycled.pt", "--moe-expert-count", "4"],
}


# upcycle starts from a single dense file
RUNS = [(c, layout) for c in sorted(COMMANDS) for layout in ("set", "single") if (c, layout) != ("upcycle", "set")]


@pytest.mark.parametrize("command, layout", RUNS, ids=[f"{c}-{layout}" for c, layout in RUNS])
def test_the_tool_refuses_a_pickle_running_a_shell_command_and_never_runs_it(tmp_path, capsys, command, layout):
    source = forged(tmp_path, layout)
    argv = [source if a == "{src}" else a for a in COMMANDS[command](tmp_path / "out")]
    code, err = run_tool(capsys, *argv)
    assert not (tmp_path / MARKER).exists(), "the pickled command ran"
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and REFUSED in err[0], err
    assert not list((tmp_path / "out").iterdir())


def test_import_fairseq_moe_refuses_a_pickle_running_a_shell_command_and_never_runs_it(tmp_path, capsys):
    source = tmp_path / "branch"
    source.mkdir()
    state = full_state()
    torch.save({"model": {}, "cfg": None}, source / "ck-rank-0.pt")
    plant(source / "ck-shared.pt", tmp_path / MARKER, state={"model": state["model"]})
    (tmp_path / "out").mkdir()
    code, err = run_tool(capsys, "import-fairseq-moe", source / "ck", tmp_path / "out" / "imported.pt")
    assert not (tmp_path / MARKER).exists(), "the pickled command ran"
    assert code == 2 and len(err) == 1 and REFUSED in err[0] and "ck-shared.pt" in err[0], err
    assert not list((tmp_path / "out").iterdir())


def test_import_hf_refuses_a_pytorch_model_bin_whose_pickle_runs_a_command(tmp_path, capsys):
    """import-hf reads .bin shards through the restricted unpickler: a pickle that runs a command is refused."""
    source = tmp_path / "hf"
    source.mkdir()
    shape = dict.fromkeys(REQUIRED_INTEGERS, 4)
    (source / "config.json").write_text(json.dumps({"model_type": "nllb-moe", **shape}))
    plant(source / "pytorch_model.bin", tmp_path / MARKER, state={"model": {}})
    (tmp_path / "out").mkdir()
    code, err = run_tool(capsys, "import-hf", source, tmp_path / "out" / "imported.pt")
    assert not (tmp_path / MARKER).exists(), "the pickled command ran"
    assert code == 2 and len(err) == 1 and REFUSED in err[0] and "pytorch_model.bin" in err[0], err
    assert not list((tmp_path / "out").iterdir())
