"""The NLLB-200 MoE release was saved in 2022, under numpy 1.x: a numpy scalar in its meters is pickled as
``numpy.core.multiarray.scalar``. The release lookalike (``recipes/nllb_tiny_set.py``) pickled again so, every
file (support/inputs/numpy1_pickles.py), in torch's zip format and in its legacy (pre-1.6) one, imports with
``import-fairseq-moe`` to the very tensors the lookalike as written imports to."""

import sys

import pytest
import torch

from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from fairseq_moe_ext.checkpoint.safe_load import safe_load
from support.inputs.numpy1_pickles import data_pickle, pickled_globals, save_numpy1
from support.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "recipes"))
from nllb_tiny_set import write_release_set  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")


def imported(prefix, out):
    out.mkdir()
    assert checkpoint_tool(["import-fairseq-moe", str(prefix), str(out / "ck.pt"), "--world-size", "2"]) == 0
    return [safe_load(str(out / f"ck-rank-{r}-of-2.pt"))["model"] for r in (0, 1)]


@pytest.mark.parametrize("form", ["zip", "legacy"])
def test_a_release_set_pickled_under_numpy1_imports_to_the_same_tensors(tmp_path, form):
    prefix = write_release_set(str(tmp_path / "release"), first_experts_only=True)
    want = imported(prefix, tmp_path / "as-written")
    files = sorted((tmp_path / "release").glob("*.pt"))
    for path in files:
        state = torch.load(path, weights_only=False)  # the test's own files
        save_numpy1(state, path, legacy=form == "legacy")
    if form == "zip":
        assert all("numpy.core.multiarray.scalar" in pickled_globals(data_pickle(p)) for p in files)
    else:
        assert all(p.read_bytes()[:1] == b"\x80" for p in files)
    got = imported(prefix, tmp_path / "numpy1")
    for mine, theirs in zip(got, want):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
