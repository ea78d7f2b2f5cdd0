"""``python -m fairseq_moe_ext.checkpoint import-fairseq-moe``: a moe/nllb-branch set (written here in
that branch's layout, tests/support/inputs/branch_sets.py) becomes a checkpoint this project's fairseq models load
and compute the same function with; what it cannot represent is refused in one line, writing nothing."""

import argparse

import pytest
import torch

from fairseq import checkpoint_utils
from fairseq_moe_ext.checkpoint import load_full
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from fairseq_moe_ext.checkpoint.branch.options import branch_flags
from support.inputs.branch_sets import branch_options, consolidate_in_place, write_branch_set
from support.inputs.fake_checkpoints import fingerprint
from support.inputs.tiny_fairseq_models import translation, translation_batch

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
EXPERTS = 4


@pytest.fixture(scope="module")
def model(data):  # noqa: F811
    built = translation(
        data, "--moe-expert-count", str(EXPERTS), "--moe-normalize-gate", "--moe-eval-capacity-factor", "0"
    )
    built.model.eval()
    return built


def model_args(built):
    return built.model.args if hasattr(built.model, "args") else built.model.cfg


def logits(model, task):
    with torch.no_grad():
        return model(**translation_batch(task)["net_input"])[0]


def imported_model(path, task):
    models, _ = checkpoint_utils.load_model_ensemble([str(path)], task=task)
    return models[0].eval()


@pytest.mark.parametrize(
    "ranks, workers",
    [(1, 1), (2, 1), (4, 2), (8, 1), (8, 4)],
    ids=["one-rank-file", "two-experts-per-rank", "into-2-workers", "replicas", "replicas-into-4"],
)
def test_an_imported_branch_set_loads_into_moe_transformer_and_computes_the_same_logits(
    data, model, tmp_path, capsys, ranks, workers
):  # noqa: F811
    prefix = write_branch_set(
        tmp_path / "nllb" / "checkpoint_best", model.model.state_dict(), branch_options(data), ranks
    )
    (tmp_path / "out").mkdir()
    assert (
        checkpoint_tool(
            ["import-fairseq-moe", str(prefix), str(tmp_path / "out" / "imported.pt"), "--world-size", str(workers)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"{ranks} rank files + shared" in printed and f"{EXPERTS} experts" in printed
    assert "--moe-eval-capacity-factor 0.0" in printed and "--moe-normalize-gate True" in printed
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == (
        ["imported.pt"]
        if workers == 1
        else [f"imported-rank-{r}-of-{workers}.pt" for r in range(workers)] + ["imported.set.json"]
    )
    assert torch.equal(
        logits(imported_model(tmp_path / "out" / "imported.pt", model.task), model.task),
        logits(model.model, model.task),
    )


def test_branch_options_become_this_projects_flags_and_inexact_ones_are_printed_as_notes(data, model, tmp_path, capsys):  # noqa: F811
    options = branch_options(
        data,
        moe_second_expert_policy="sampling",
        moe_eval_capacity_token_fraction=0.5,
        encoder_moe_freq=1,
        moe_freq=2,
        moe_eom=0.2,
    )
    prefix = write_branch_set(tmp_path / "nllb" / "ck", model.model.state_dict(), options, 2, cfg_as_dict=False)
    assert checkpoint_tool(["import-fairseq-moe", str(prefix), str(tmp_path / "imported.pt")]) == 0
    printed = capsys.readouterr().out
    assert "NOTE --moe-second-expert-policy sampling: the second expert is drawn at random" in printed
    assert "--moe-second-expert-policy sampling" in printed.split("flags: ")[1]
    assert "--moe-eval-capacity-token-fraction 0.5" in printed  # ceil(0.5 S), as the branch
    assert "--moe-normalize-gate True --moe-normalize-gate-after-dropping True" in printed  # the branch's default
    assert "--moe-batch-major-routing True" in printed
    assert "--encoder-moe-freq 2" in printed  # max(encoder_moe_freq, moe_freq), as the branch's encoder reads it
    assert "--moe-eom 0.2" in printed  # Expert Output Masking, as NLLB-200 MoE was trained with it
    assert "--moe-normalize-expert-grad sqrt_world_size" in printed.split("flags: ")[1]  # the NLLB-like set's
    assert "NOTE training only: --moe-local-drop is not reproduced" in printed and "balance loss" not in printed
    state = torch.load(tmp_path / "imported.pt", weights_only=False)
    assert state["args"].arch == "moe_transformer" and state["args"].moe_eval_capacity_token_fraction == 0.5
    assert state["args"].moe_eom == 0.2 and state["args"].moe_normalize_expert_grad == "sqrt_world_size"
    # The branch's other value is this project's default: no flag.
    exact, _ = branch_flags(
        argparse.Namespace(**{**vars(options), "moe_normalize_expert_grad": "world_size"}), "ck", {}
    )
    assert "moe_normalize_expert_grad" not in exact
    assert "last_optimizer_state" not in state and state["moe"]["num_updates"] == 300


def test_import_streams_one_rank_file_at_a_time_and_writes_each_output_file_once_complete(
    data, model, tmp_path, monkeypatch
):  # noqa: F811
    from fairseq_moe_ext.checkpoint.branch import importer as branch_import

    prefix = write_branch_set(tmp_path / "nllb" / "ck", model.model.state_dict(), branch_options(data), 4)
    events, real_load, real_save = [], branch_import.load_skipping, torch.save
    monkeypatch.setattr(
        branch_import, "load_skipping", lambda p, **k: events.append(("load", p.split("-")[-1])) or real_load(p, **k)
    )
    monkeypatch.setattr(
        branch_import.torch, "save", lambda s, p: events.append(("save", p.split("-")[-3])) or real_save(s, p)
    )
    branch_import.import_branch_set(str(prefix), str(tmp_path / "imported.pt"), 4, report=lambda line: None)
    assert events == [
        ("load", "shared.pt"),
        ("load", "0.pt"),
        ("save", "0"),
        ("load", "1.pt"),
        ("save", "1"),
        ("load", "2.pt"),
        ("save", "2"),
        ("load", "3.pt"),
        ("save", "3"),
    ]


@pytest.mark.parametrize(
    "given", ["ck", "ck_consolidated", "ck_consolidated.pt"], ids=["training-prefix", "consolidated", "printed-name"]
)
def test_consolidated_fsdp_files_import_to_the_same_tensors_as_the_plain_set_of_the_model(
    data, model, tmp_path, capsys, given
):  # noqa: F811
    imported = {}
    for layout in ("plain", "fsdp"):
        write_branch_set(tmp_path / layout / "ck", model.model.state_dict(), branch_options(data), 4)
        if layout == "fsdp":
            consolidate_in_place(tmp_path / layout)
        (tmp_path / f"{layout}-out").mkdir()
        out = tmp_path / f"{layout}-out" / "imported.pt"
        source = tmp_path / layout / (given if layout == "fsdp" else "ck")
        assert checkpoint_tool(["import-fairseq-moe", str(source), str(out), "--world-size", "2"]) == 0
        imported[layout] = load_full(str(out))["model"]
    printed = capsys.readouterr().out
    assert f"found {tmp_path / 'fsdp' / 'ck_consolidated'}: 4 rank files + shared" in printed
    assert ("NOTE reading " in printed) == (given == "ck")
    plain, fsdp = imported["plain"], imported["fsdp"]
    assert sorted(plain) == sorted(fsdp) and len(plain) > 20
    assert all(torch.equal(plain[k], fsdp[k]) and plain[k].dtype == fsdp[k].dtype for k in plain)


# ---------------------------------------------------------------- bad input: one line, nothing written


def _remove(name):
    return lambda d: (d / name).unlink()


def _copy(src, dst):
    return lambda d: (d / dst).write_bytes((d / src).read_bytes())


def _truncate(name):
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[:300])


def _edit_rank(name, edit, edit_file=None):
    def damage(d):
        state = torch.load(d / name, weights_only=False)
        edit(state["model"]) if edit else edit_file(state)
        torch.save(state, d / name)

    return damage


def _edit_file(name, edit):
    return _edit_rank(name, None, edit)


def _saved_at(updates):
    return lambda state: state["optimizer_history"][-1].update(num_updates=updates)


def _seeded(seed):
    return lambda state: state["cfg"]["common"].update(seed=seed)


def _narrow_fc1(model):
    key = next(k for k in model if k.endswith("fc1.weight"))
    model[key] = model[key][:-1]


def _nudge_expert(model):
    key = next(k for k in model if k.endswith("fc2.bias"))
    model[key] = model[key] + 1e-3


def _add_key(model):
    model["decoder.embed_tokens.weight"] = torch.zeros(3, 3)


def _hf_dir(d):
    (d.parent / "hf").mkdir()
    (d.parent / "hf" / "config.json").write_text('{"model_type": "nllb-moe"}')


def _also_consolidated(d):
    for f in list(d.glob("ck-*.pt")):
        (d / f.name.replace("ck-", "ck_consolidated-", 1)).write_bytes(f.read_bytes())


def _consolidated_without(name):
    return lambda d: consolidate_in_place(d) and (d / name).unlink()


def _flat_parameters(model):
    model.clear()
    model["decoder.layers.1.moe_layer.experts.0._fsdp_wrapped_module.flat_param_0"] = torch.zeros(8)


def _fsdp_shards(d):
    for f in list(d.iterdir()):
        if f.suffix == ".pt":
            f.rename(f.with_name(f.stem + "-shard0.pt"))


# fmt: off
BAD_BRANCH_SETS = [
    # (id, rank files, option changes, damage, prefix (default the set's), the one line says)
    ("missing-rank-file", 4, {}, _remove("ck-rank-2.pt"), None, "ck-rank-2.pt is missing (found ranks [0, 1, 3])"),
    ("missing-last-rank-file", 4, {}, _remove("ck-rank-3.pt"), None, "ck-rank-3.pt is missing: the run had 4 workers"),
    ("extra-rank-file", 4, {}, _copy("ck-rank-3.pt", "ck-rank-4.pt"), None, "an extra rank file from another run"),
    ("missing-shared-file", 4, {}, _remove("ck-shared.pt"), None, "ck-shared.pt is missing"),
    ("shapes-disagree", 4, {}, _edit_rank("ck-rank-2.pt", _narrow_fc1), None, "has shape [127, 64], but"),
    ("replicas-differ", 8, {}, _edit_rank("ck-rank-5.pt", _nudge_expert), None, "hold different copies of expert 1"),
    ("truncated-pickle", 4, {}, _truncate("ck-rank-1.pt"), None, "ck-rank-1.pt is damaged or incomplete"),
    ("another-models-keys", 4, {}, _edit_rank("ck-rank-1.pt", _add_key), None,
     "holds decoder.embed_tokens.weight, which is not a branch expert parameter"),
    ("cmr-gating", 2, {"moe_cmr": True}, None, None, "--moe-cmr True (CMR gating"),
    ("final-output-masking", 2, {"moe_fom": 0.1}, None, None, "--moe-fom 0.1 (final output masking"),
    ("unknown-gate-option", 2, {"moe_second_expert_policy": "best"}, None, None,
     "--moe-second-expert-policy 'best', which the branch's top-2 gate does not define"),
    ("a-hugging-face-directory", 2, {}, _hf_dir, "../hf", "a Hugging Face checkpoint; use import-hf"),
    ("fsdp-shard-numbers-differ", 2, {}, _fsdp_shards, None, "ck-rank-1-shard0.pt: an expert file's rank and shard"),
    ("plain-and-consolidated-files", 2, {}, _also_consolidated, None,
     "ck_consolidated-*.pt are both here: a plain set and a consolidated FSDP one"),
    ("missing-consolidated-rank-file", 4, {}, _consolidated_without("ck_consolidated-rank-1.pt"), None,
     "ck_consolidated-rank-1.pt is missing (found ranks [0, 2, 3]): every rank file of the run is needed; copy it "
     "beside the others; consolidation stopped before it (ck-rank-1-shard1.pt is here)"),
    # a file of another save or run: update, seed and model options each compared with rank 0's
    ("rank-file-of-another-update", 4, {}, _edit_file("ck-rank-2.pt", _saved_at(250)), None,
     "ck-rank-2.pt was saved at update 250 and "),
    ("shared-file-of-another-update", 4, {}, _edit_file("ck-shared.pt", _saved_at(250)), None,
     "ck-shared.pt was saved at update 250 and "),
    ("rank-file-of-another-seed", 4, {}, _edit_file("ck-rank-3.pt", _seeded(3)), None,
     "ck-rank-3.pt was trained with --seed 3 and "),
    ("rank-file-of-another-gate-option", 4, {}, _edit_file("ck-rank-1.pt", lambda s: setattr(
        s["cfg"]["model"], "moe_eval_capacity_token_fraction", 0.5)), None,
     "ck-rank-1.pt was trained with --moe-eval-capacity-token-fraction 0.5 and "),
    ("unconsolidated-flat-parameters", 2, {}, _edit_rank("ck-rank-1.pt", _flat_parameters), None,
     "ck-rank-1.pt holds decoder.layers.1.moe_layer.experts.0._fsdp_wrapped_module.flat_param_0, an FSDP flat"),
]
# fmt: on


@pytest.mark.parametrize(
    "ranks, changes, damage, prefix, message",
    [row[1:] for row in BAD_BRANCH_SETS],
    ids=[row[0] for row in BAD_BRANCH_SETS],
)
def test_a_bad_branch_set_is_refused_in_one_line_and_nothing_is_written(
    data, model, tmp_path, capsys, ranks, changes, damage, prefix, message
):  # noqa: F811
    source = tmp_path / "nllb"
    write_branch_set(source / "ck", model.model.state_dict(), branch_options(data, **changes), ranks)
    if damage is not None:
        damage(source)
    out = tmp_path / "out"
    out.mkdir()
    before = fingerprint(source)
    code = checkpoint_tool(
        ["import-fairseq-moe", str(source / (prefix or "ck")), str(out / "imported.pt"), "--world-size", "2"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert fingerprint(out) == {} and fingerprint(source) == before
