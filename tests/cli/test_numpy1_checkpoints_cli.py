"""A dense fairseq checkpoint saved under numpy 1.x, in torch's zip format and in its legacy (pre-1.6) one, is
upcycled, resumed and generated from by the command lines, as a user's older checkpoint would be.

The checkpoint is fairseq-train's own (a dense ``transformer``, ``--eval-bleu``: fairseq keeps its BLEU counters
as numpy arrays in the checkpoint's meters), pickled again as numpy 1.x pickles it (``numpy.core.multiarray.*``,
support/inputs/numpy1_pickles.py) by torch.save, in each format. Before numpy 1.x's names were allowed, every
one of these runs stopped at the load (``it pickles numpy.core.multiarray._reconstruct``)."""

import re

import pytest

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.inputs.numpy1_pickles import data_pickle, pickled_globals, save_numpy1
from support.launch.fairseq_helpers import USER_DIR, json_logs, run_fairseq, train_args

pytestmark = pytest.mark.slow
# fmt: off
SHAPE = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
         "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--max-tokens", "500"]
DENSE = ["--arch", "transformer", "--criterion", "label_smoothed_cross_entropy", *SHAPE, "--eval-bleu",
         "--eval-bleu-args", '{"beam": 1, "max_len_b": 5}']
MOE = ["--arch", "moe_transformer", "--criterion", "moe_label_smoothed_cross_entropy", *SHAPE, "--moe-expert-count",
       "4", "--moe-top-k", "2", "--moe-normalize-gate", "--ddp-backend", "legacy_ddp"]
# fmt: on
UPDATES = 3


@pytest.fixture(scope="module")
def numpy1(parallel_data, tmp_path_factory):
    """(data, {"zip": path, "legacy": path}): fairseq-train's dense checkpoint pickled again as under numpy 1.x."""
    root = tmp_path_factory.mktemp("numpy1")
    run_fairseq("train", *train_args(parallel_data, root / "dense", *DENSE, max_update=UPDATES))
    state = moe_ckpt.safe_load(str(root / "dense" / "checkpoint_last.pt"))
    files = {"zip": root / "numpy1.pt", "legacy": root / "numpy1-legacy.pt"}
    for form, path in files.items():
        save_numpy1(state, path, legacy=form == "legacy")
    assert "numpy.core.multiarray._reconstruct" in pickled_globals(data_pickle(files["zip"]))
    assert files["legacy"].read_bytes()[:1] == b"\x80"  # a bare pickle, not a zip archive
    return parallel_data, files


@pytest.mark.parametrize("form", ["zip", "legacy"])
def test_a_numpy1_dense_checkpoint_resumes_from_its_update(numpy1, tmp_path, form):
    data, files = numpy1
    output = run_fairseq(
        "train", *train_args(data, tmp_path, *DENSE, "--restore-file", files[form], max_update=UPDATES + 1)
    )
    assert re.search(rf"Loaded checkpoint .*numpy1.* \(epoch \d+ @ {UPDATES} updates\)", output), output[-2000:]
    assert moe_ckpt.safe_load(str(tmp_path / "checkpoint_last.pt"))["optimizer_history"][-1]["num_updates"] == 4


@pytest.mark.parametrize("form", ["zip", "legacy"])
def test_a_numpy1_dense_checkpoint_upcycles_by_the_tool_and_by_moe_upcycle_from(numpy1, tmp_path, form):
    data, files = numpy1
    assert checkpoint_tool(["upcycle", str(files[form]), str(tmp_path / "up.pt"), "--moe-expert-count", "4"]) == 0
    output = run_fairseq(
        "train", *train_args(data, tmp_path / "moe", *MOE, "--moe-upcycle-from", files[form], max_update=1)
    )
    assert [r["train_num_updates"] for r in json_logs(output, "train")] == ["1"], output[-2000:]


def test_fairseq_generate_translates_from_a_numpy1_legacy_checkpoint(numpy1):
    data, files = numpy1
    output = run_fairseq(
        "generate",
        data,
        "--user-dir",
        USER_DIR,
        "--path",
        files["legacy"],
        "--cpu",
        "--beam",
        "1",
        "--batch-size",
        "16",
    )
    assert len(re.findall(r"^H-\d+\t", output, re.M)) == 16, output[-2000:]
