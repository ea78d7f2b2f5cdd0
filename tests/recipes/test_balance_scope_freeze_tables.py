"""recipes/summarize_balance_freeze.py: the tables recipes/balance_scope_freeze.sh prints, from the files its
runs leave (written here in the runs' formats: main.sh's moe/bleu.json, moe/train.log and routing.json, the
fine-tunes' bleu.json). The whole pipeline's tiny mode (TINY=1, about 2 minutes of CPU) was run by hand
(docs/routing.md); here only what turns the runs into numbers, in a fraction of a second."""

import json
import sys

import pytest

from support.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "recipes"))
from summarize_balance_freeze import main  # noqa: E402

DIALECTS = ("harbor", "lowland", "steppe")


def write_scope_run(run, bleu, valid_losses, mi):
    (run / "moe").mkdir(parents=True)
    (run / "moe" / "bleu.json").write_text(json.dumps({"bleu": bleu, "by_domain": dict(zip(DIALECTS, [bleu] * 3))}))
    log = "".join(f'| INFO | valid | {{"epoch": {i}, "valid_loss": "{v}"}}\n' for i, v in enumerate(valid_losses))
    (run / "moe" / "train.log").write_text(log)
    layers = {layer: {"share": [], "mi_fraction": value} for layer, value in mi.items()}
    (run / "routing.json").write_text(json.dumps({"domains": list(DIALECTS), "layers": layers}))


def write_finetune(work, freeze, by_domain):
    (work / "finetune" / freeze).mkdir(parents=True)
    (work / "finetune" / freeze / "bleu.json").write_text(json.dumps({"bleu": 0, "by_domain": by_domain}))


def test_the_tables_give_each_run_the_means_the_scope_difference_and_the_forgetting(tmp_path, capsys):
    write_scope_run(tmp_path / "seed1" / "micro-batch", 40.0, ["3.0", "2.5"], {"enc1": 0.2, "dec1": 0.05})
    write_scope_run(tmp_path / "seed1" / "global-batch", 44.0, ["2.9", "2.4"], {"enc1": 0.3, "dec1": 0.04})
    write_scope_run(tmp_path / "seed2" / "micro-batch", 42.0, ["2.7"], {"enc1": 0.4, "dec1": 0.07})
    (tmp_path / "seed1" / "micro-batch" / "moe" / "bleu.json").write_text(
        json.dumps({"bleu": 40.0, "by_domain": {"harbor": 30.0, "lowland": 50.0, "steppe": 40.0}})
    )
    write_finetune(tmp_path, "none", {"harbor": 60.0, "lowland": 20.0, "steppe": 30.0})
    write_finetune(tmp_path, "router", {"harbor": 55.0, "lowland": 40.0, "steppe": 44.0})
    main([str(tmp_path), "--dialect", "harbor"])
    out = capsys.readouterr().out
    rows = {tuple(c.strip() for c in line.strip("|").split("|")) for line in out.splitlines() if line.startswith("| ")}
    assert ("1", "global-batch", "44.00", "2.400", "0.040", "0.300") in rows  # the last validation loss
    assert ("mean of 2", "micro-batch", "41.00", "2.600", "0.060", "0.300") in rows
    assert ("difference", "global - micro", "3.00", "-0.200", "-0.020", "0.000") in rows
    assert ("base (before fine-tuning)", "30.00", "45.00", "", "") in rows
    assert ("fine-tuned, router trained", "60.00", "25.00", "+30.00", "-20.00") in rows
    assert ("fine-tuned, --moe-freeze router", "55.00", "42.00", "+25.00", "-3.00") in rows


def test_a_work_dir_without_a_finished_run_says_so_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path)])
    assert str(stopped.value).startswith(f"no finished run under {tmp_path}: run recipes/balance_scope_freeze.sh")
