"""``python -m fairseq_moe_ext.checkpoint import-fairseq-moe``: a moe/nllb-branch set (written here in
that branch's layout, tests/branch_sets.py) becomes a checkpoint this project's fairseq models load
and compute the same function with; what it cannot represent is refused in one line, writing nothing."""

import argparse

import pytest
import torch
from fairseq import checkpoint_utils

from branch_sets import branch_model_options, write_branch_set
from fake_checkpoints import fingerprint
from test_fairseq_models import data, translation, translation_batch  # noqa: F401  (data: fixture)
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
EXPERTS = 4


@pytest.fixture(scope="module")
def model(data):  # noqa: F811
    built = translation(data, "--moe-expert-count", str(EXPERTS), "--moe-normalize-gate",
                        "--moe-eval-capacity-factor", "0")
    built.model.eval()
    return built


def model_args(built):
    return built.model.args if hasattr(built.model, "args") else built.model.cfg


def branch_options(data, **changes):  # noqa: F811
    from fairseq import options as fairseq_options
    from fairseq_helpers import USER_DIR

    parser = fairseq_options.get_training_parser()
    args = fairseq_options.parse_args_and_arch(parser, [
        str(data), "--user-dir", USER_DIR, "--task", "translation", "--arch", "moe_transformer_tiny", "--cpu",
        "--source-lang", "src", "--target-lang", "tgt", "--moe-expert-count", str(EXPERTS)])
    return branch_model_options(args, EXPERTS, **changes)


def logits(model, task):
    with torch.no_grad():
        return model(**translation_batch(task)["net_input"])[0]


def imported_model(path, task):
    models, _ = checkpoint_utils.load_model_ensemble([str(path)], task=task)
    return models[0].eval()


@pytest.mark.parametrize("ranks, workers", [(1, 1), (2, 1), (4, 2), (8, 1), (8, 4)],
                         ids=["one-rank-file", "two-experts-per-rank", "into-2-workers", "replicas", "replicas-into-4"])
def test_an_imported_branch_set_loads_into_moe_transformer_and_computes_the_same_logits(
        data, model, tmp_path, capsys, ranks, workers):  # noqa: F811
    prefix = write_branch_set(tmp_path / "nllb" / "checkpoint_best", model.model.state_dict(), branch_options(data),
                              ranks)
    (tmp_path / "out").mkdir()
    assert checkpoint_tool(["import-fairseq-moe", str(prefix), str(tmp_path / "out" / "imported.pt"),
                            "--world-size", str(workers)]) == 0
    printed = capsys.readouterr().out
    assert f"{ranks} rank files + shared" in printed and f"{EXPERTS} experts" in printed
    assert "--moe-eval-capacity-factor 0.0" in printed and "--moe-normalize-gate True" in printed
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == (["imported.pt"] if workers == 1 else
                     [f"imported-rank-{r}-of-{workers}.pt" for r in range(workers)] + ["imported.set.json"])
    assert torch.equal(logits(imported_model(tmp_path / "out" / "imported.pt", model.task), model.task),
                       logits(model.model, model.task))


def test_branch_options_become_this_projects_flags_and_inexact_ones_are_printed_as_notes(data, model, tmp_path,
                                                                                       capsys):  # noqa: F811
    options = branch_options(data, moe_second_expert_policy="sampling", moe_eval_capacity_token_fraction=0.5,
                             encoder_moe_freq=1, moe_freq=2)
    prefix = write_branch_set(tmp_path / "nllb" / "ck", model.model.state_dict(), options, 2, cfg_as_dict=False)
    assert checkpoint_tool(["import-fairseq-moe", str(prefix), str(tmp_path / "imported.pt")]) == 0
    printed = capsys.readouterr().out
    assert "NOTE --moe-second-expert-policy sampling" in printed
    assert f"--moe-eval-capacity-factor {0.5 * EXPERTS / 2:g}" in printed  # ceil(0.5 S) ~ 2 int(cf ceil(S/E))
    assert "--encoder-moe-freq 2" in printed  # max(encoder_moe_freq, moe_freq), as the branch's encoder reads it
    state = torch.load(tmp_path / "imported.pt", weights_only=False)
    assert state["args"].arch == "moe_transformer" and state["args"].moe_eval_capacity_factor == 1.0
    assert "last_optimizer_state" not in state and state["moe"]["num_updates"] == 300


def test_import_streams_one_rank_file_at_a_time_and_writes_each_output_file_once_complete(
        data, model, tmp_path, monkeypatch):  # noqa: F811
    from fairseq_moe_ext.checkpoint import branch_import

    prefix = write_branch_set(tmp_path / "nllb" / "ck", model.model.state_dict(), branch_options(data), 4)
    events, real_load, real_save = [], branch_import.safe_load, torch.save
    monkeypatch.setattr(branch_import.BranchSet.__init__, "__defaults__", (lambda p: events.append(("load", p.split("-")[-1])) or real_load(p),))
    monkeypatch.setattr(branch_import.torch, "save", lambda s, p: events.append(("save", p.split("-")[-3])) or real_save(s, p))
    branch_import.import_branch_set(str(prefix), str(tmp_path / "imported.pt"), 4, report=lambda line: None)
    assert events == [("load", "shared.pt"), ("load", "0.pt"), ("save", "0"), ("load", "1.pt"), ("save", "1"),
                      ("load", "2.pt"), ("save", "2"), ("load", "3.pt"), ("save", "3")]
