"""Checkpoints pickled under numpy 1.x name their numpy objects ``numpy.core.multiarray.*``; numpy 2 (and so the
allow-list's objects) name them ``numpy._core.multiarray.*``, and torch's weights-only unpickler does not map one
to the other. The allow-list (checkpoint/safe_load.py) takes numpy 1.x's names for exactly the objects it allows
under numpy 2's, and every loader of the checkpoint tool reads such a file, in torch's zip format and in its
legacy one; a numpy 1.x name of any other object is refused as before. The pickles: support/inputs/numpy1_pickles.py
(its bytes checked here against what numpy 1.26.4 wrote)."""

import pickle

import numpy
import pytest
import torch

from fairseq_moe_ext.checkpoint import CHECKPOINT_SAFE_GLOBALS
from fairseq_moe_ext.checkpoint import __main__ as tool
from fairseq_moe_ext.checkpoint.one_read import load_skipping
from fairseq_moe_ext.checkpoint.safe_load import safe_load
from support.inputs import numpy1_pickles
from support.inputs.fake_checkpoints import full_state
from support.inputs.numpy1_pickles import (
    NUMPY_1_26_4_BYTES,
    OBJECTS,
    data_pickle,
    numpy1_dumps,
    pickled_globals,
    save_numpy1,
)

FORMATS = ("zip", "legacy")


def with_numpy_objects(state):
    """``state`` holding numpy objects where fairseq keeps them: --eval-bleu's counters (arrays) in the meters,
    a numpy scalar as the best validation loss."""
    counts = {f"_bleu_counts_{i}": numpy.array([12.0 - i, 3.0]) for i in range(2)}
    state["extra_state"].update(metrics={"valid": counts}, best=numpy.float64(2.5), val_loss=numpy.float32(2.75))
    return state


def numpy1_file(path, legacy):
    save_numpy1(with_numpy_objects(full_state()), path, legacy=legacy)
    if not legacy:
        assert {"numpy.core.multiarray.scalar", "numpy.core.multiarray._reconstruct"} <= set(
            pickled_globals(data_pickle(path))
        )
    else:
        assert open(path, "rb").read(1) == b"\x80"  # a bare pickle: torch's pre-1.6 format
    return path


@pytest.mark.parametrize("name", sorted(NUMPY_1_26_4_BYTES))
def test_the_numpy1_pickler_writes_the_very_bytes_numpy_1_26_4_wrote(name):
    written = numpy1_dumps(OBJECTS[name])
    assert written.hex() == NUMPY_1_26_4_BYTES[name]
    names = pickled_globals(written)
    assert any(n.startswith("numpy.core.multiarray.") for n in names)
    assert not any(n.startswith("numpy._core") for n in names)


def test_numpy1_names_are_allowed_for_the_objects_allowed_under_numpy2_names_only():
    objects = [entry for entry in CHECKPOINT_SAFE_GLOBALS if not isinstance(entry, tuple)]
    aliases = {name: obj for obj, name in (e for e in CHECKPOINT_SAFE_GLOBALS if isinstance(e, tuple))}
    assert set(aliases) == {"numpy.core.multiarray.scalar", "numpy.core.multiarray._reconstruct"}
    for name, obj in aliases.items():
        assert obj in objects and f"{obj.__module__}.{obj.__qualname__}" == name.replace("numpy.core", "numpy._core")


@pytest.mark.parametrize("form", FORMATS)
def test_a_checkpoint_pickled_under_numpy1_loads_whole_and_in_one_read(tmp_path, form):
    path = numpy1_file(tmp_path / "numpy1.pt", legacy=form == "legacy")
    for state in (safe_load(str(path)), load_skipping(str(path))):
        assert state["extra_state"]["best"] == 2.5 and isinstance(state["extra_state"]["best"], numpy.float64)
        assert (state["extra_state"]["metrics"]["valid"]["_bleu_counts_1"] == [11.0, 3.0]).all()
        assert torch.equal(
            state["model"]["encoder.embed_tokens.weight"], full_state()["model"]["encoder.embed_tokens.weight"]
        )


COMMANDS = {
    "inspect": lambda src, out: ["inspect", src],
    "merge": lambda src, out: ["merge", src, out / "merged.pt"],
    "reshard": lambda src, out: ["reshard", src, out / "resharded.pt", "--world-size", "2"],
}  # upcycle, resume and generate start from a fairseq model's checkpoint: tests/cli/test_numpy1_checkpoints_cli.py


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_checkpoint_tool_reads_a_numpy1_pickle_in_both_formats(tmp_path, capsys, command, form):
    source = tmp_path / "in"
    source.mkdir(), (tmp_path / "out").mkdir()
    path = numpy1_file(source / "checkpoint_last.pt", legacy=form == "legacy")
    code = tool.main([str(a) for a in COMMANDS[command](path, tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err


class _Frombuffer:
    def __reduce__(self):
        return numpy1_pickles._MULTIARRAY.multiarray.frombuffer, (b"\0" * 8,)


def test_a_numpy1_name_of_an_object_not_allowed_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    frombuffer = numpy1_pickles._MULTIARRAY.multiarray.frombuffer
    monkeypatch.setitem(numpy1_pickles.NUMPY_1_MODULE, frombuffer, "numpy.core.multiarray")
    state = full_state()
    state["extra_state"]["buffer"] = _Frombuffer()
    save_numpy1(state, tmp_path / "checkpoint_last.pt")
    assert "numpy.core.multiarray.frombuffer" in pickled_globals(data_pickle(tmp_path / "checkpoint_last.pt"))
    code = tool.main(["inspect", str(tmp_path / "checkpoint_last.pt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "it pickles numpy.core.multiarray.frombuffer, which is not among the types" in err[0]
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
