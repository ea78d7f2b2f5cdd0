"""``import-fairseq-moe`` on the raw files of a moe/nllb-branch FSDP run (``-shared-shard<r>.pt``,
``-rank-<r>-shard<r>.pt``; written here in that layout by tests/support/inputs/branch_fsdp.py with fairscale 0.4's
metadata): the import equals the plain set's, bitwise, and fairscale's own ``consolidate_shard_weights``
(tests/requirements-fairscale.txt) gives the same tensors; bad shard files are refused in one line."""

import shutil
import subprocess
import sys

import pytest
import torch

from fairseq_moe_ext.checkpoint import load_full
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.inputs.branch_fsdp import shard_in_place
from support.inputs.branch_sets import branch_model_options, write_branch_set
from support.inputs.fake_checkpoints import fingerprint
from support.inputs.tiny_fairseq_models import translation
from support.launch.fairseq_helpers import fairseq_env
from support.oracles.fairscale_oracle import fairscale_fsdp

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
EXPERTS = 4


@pytest.fixture(scope="module")
def model(data):  # noqa: F811
    tied = "--share-decoder-input-output-embed"  # a tied output projection: FSDP keeps it as shared_param_info
    return translation(data, "--moe-expert-count", str(EXPERTS), "--moe-eval-capacity-factor", "0", tied)


@pytest.fixture(scope="module")
def options(data):  # noqa: F811
    from fairseq import options as fairseq_options
    from support.launch.fairseq_helpers import USER_DIR

    flags = ["--user-dir", USER_DIR, "--task", "translation", "--arch", "moe_transformer_tiny", "--cpu"]
    flags += ["--source-lang", "src", "--target-lang", "tgt", "--moe-expert-count", str(EXPERTS)]
    flags += ["--share-decoder-input-output-embed"]
    args = fairseq_options.parse_args_and_arch(fairseq_options.get_training_parser(), [str(data), *flags])
    return branch_model_options(args, EXPERTS)


def _import(source, out_dir):
    out_dir.mkdir()
    assert checkpoint_tool(["import-fairseq-moe", str(source), str(out_dir / "imported.pt"), "--world-size", "2"]) == 0
    return load_full(str(out_dir / "imported.pt"))["model"]


@pytest.mark.parametrize("workers", [2, 4], ids=["2-shards-2-experts-each", "4-shards-padded"])
def test_fsdp_shards_import_bitwise_as_the_plain_set_and_as_fairscale_joins(model, options, tmp_path, capsys, workers):
    for layout in ("plain", "fsdp"):
        write_branch_set(tmp_path / layout / "ck", model.model.state_dict(), options, workers)
    plain_files = {p.name: torch.load(p, weights_only=False)["model"] for p in (tmp_path / "plain").iterdir()}
    assert shard_in_place(tmp_path / "fsdp") == workers
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == sorted(
        [f"ck-shared-shard{r}.pt" for r in range(workers)] + [f"ck-rank-{r}-shard{r}.pt" for r in range(workers)]
    )
    plain = _import(tmp_path / "plain" / "ck", tmp_path / "plain-out")
    imported = _import(tmp_path / "fsdp" / "ck", tmp_path / "fsdp-out")
    assert f"NOTE joining {workers} FSDP shards (ck-shared-shard0..{workers - 1}.pt)" in capsys.readouterr().out
    assert sorted(plain) == sorted(imported) and len(plain) > 20
    assert all(torch.equal(plain[k], imported[k]) and plain[k].dtype == imported[k].dtype for k in plain)

    # The oracle: fairscale joins the files as the branch's consolidate_fsdp_shards calls it, and gets the
    # plain files' tensors. It drops the tied output projection (it copies only the last FSDP instance's
    # shared_param_info; the root's names the tie), which the import keeps.
    shards = [torch.load(tmp_path / "fsdp" / f"ck-shared-shard{r}.pt", weights_only=False) for r in range(workers)]
    with fairscale_fsdp() as fsdp:
        joined = fsdp.FullyShardedDataParallel.consolidate_shard_weights(
            [s["model"] for s in shards], [s["shard_metadata"] for s in shards], strict=False
        )
    assert set(plain_files["ck-shared.pt"]) - set(joined) == {"decoder.output_projection.weight"}
    assert all(torch.equal(joined[k], plain_files["ck-shared.pt"][k]) for k in joined)
    for r in range(workers):
        expert = torch.load(tmp_path / "fsdp" / f"ck-rank-{r}-shard{r}.pt", weights_only=False)
        alone = fsdp.FullyShardedDataParallel.consolidate_shard_weights(
            [expert["model"]], [expert["shard_metadata"]], strict=False
        )
        want = plain_files[f"ck-rank-{r}.pt"]
        assert sorted(alone) == sorted(want) and all(torch.equal(alone[k], want[k]) for k in want)


# ---------------------------------------------------------------- bad input: one line, nothing written


def _edit(name, edit):
    def damage(d):
        state = torch.load(d / name, weights_only=False)
        edit(state)
        torch.save(state, d / name)

    return damage


def _first_flat(state):
    return next(p for i in state["shard_metadata"]["param_metadata"] for p in i["params"].values())


def _pad_one_more(state):
    _first_flat(state)["padding"] += 1


def _newer_format(state):
    for instance in state["shard_metadata"]["param_metadata"]:
        for name, spec in instance["params"].items():
            instance["params"][name] = {"is_flat": True, "num_padded": spec["padding"], **spec}


def _halve_experts(state):  # each expert sharded over 2 replicas, as a run with fewer experts than workers
    for instance in state["shard_metadata"]["param_metadata"]:
        key = f"{instance['fsdp_path']}.flat_param_0"
        if key in state["model"]:
            instance["no_broadcast_optim_state"] = False
            state["model"][key] = state["model"][key][: (state["model"][key].numel() + 1) // 2].clone()


def _from_a_4_worker_run(model_state, options):
    def damage(d):
        write_branch_set(d / "four" / "ck", model_state, options, 4)
        shard_in_place(d / "four")
        shutil.copy(d / "four" / "ck-shared-shard1.pt", d / "ck-shared-shard1.pt")
        shutil.rmtree(d / "four")

    return damage


# fmt: off
BAD_SHARD_SETS = [
    # (id, damage (given the model state and options), the one line says)
    ("missing-shard-file", lambda s, o: lambda d: (d / "ck-shared-shard1.pt").unlink(),
     "ck-shared-shard1.pt is missing (shard files of 2 workers are here)"),
    ("shards-of-different-worlds-mixed", _from_a_4_worker_run,
     "ck-shared-shard1.pt and "),
    ("metadata-disagrees-with-tensors", lambda s, o: _edit("ck-shared-shard1.pt", _pad_one_more),
     "its shard_metadata's parameters need"),
    ("unknown-fairscale-metadata-format", lambda s, o: _edit("ck-shared-shard0.pt", _newer_format),
     "is not fairscale 0.4's local_metadata_dict format"),
    ("experts-sharded-over-replicas", lambda s, o: _edit("ck-rank-1-shard1.pt", _halve_experts),
     "an expert sharded over its replicas"),
    ("no-shard-metadata", lambda s, o: _edit("ck-rank-1-shard1.pt", lambda state: state.pop("shard_metadata")),
     "ck-rank-1-shard1.pt holds no shard_metadata"),
]
# fmt: on


@pytest.mark.parametrize("make, message", [row[1:] for row in BAD_SHARD_SETS], ids=[row[0] for row in BAD_SHARD_SETS])
def test_bad_fsdp_shard_files_are_refused_in_one_line_and_nothing_is_written(
    model, options, tmp_path, capsys, make, message
):
    source = tmp_path / "nllb"
    write_branch_set(source / "ck", model.model.state_dict(), options, 2)
    shard_in_place(source)
    make(model.model.state_dict(), options)(source)
    out = tmp_path / "out"
    out.mkdir()
    before = fingerprint(source)
    code = checkpoint_tool(["import-fairseq-moe", str(source / "ck"), str(out / "imported.pt"), "--world-size", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert fingerprint(out) == {} and fingerprint(source) == before


def test_fairseq_under_test_cannot_import_fairscale_which_would_change_its_paths():
    # fairseq takes other code paths where fairscale imports; the oracle lives beside site-packages.
    probe = "import importlib.util as u; print(u.find_spec('fairscale'))"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=fairseq_env())
    assert found.stdout.strip() == "None", found.stdout + found.stderr
