"""Specification of the plugin as users run it: fairseq's own command-line tools with --user-dir.

Every test starts real fairseq processes on tiny generated corpora (see fairseq_helpers). Trained
checkpoints are shared per module; a test that writes into a save dir works on its own copy.
"""

import fractions
import re
import shutil

import pytest
import torch

from support.launch.fairseq_helpers import (
    CONFIG_DIR,
    SPLITS,
    USER_DIR,
    assert_loss_falls,
    json_logs,
    logged_losses,
    run_fairseq,
    train_args,
)

pytestmark = pytest.mark.slow

# fmt: off
TRANSLATION = [
    "--arch", "moe_transformer_tiny", "--criterion", "moe_label_smoothed_cross_entropy",
    "--label-smoothing", "0.1", "--max-tokens", "1000",
]
# fmt: on
# fmt: off
LANGUAGE_MODEL = [
    "--task", "language_modeling", "--arch", "moe_transformer_lm_tiny", "--criterion", "moe_cross_entropy",
    "--tokens-per-sample", "64", "--max-tokens", "512",
]
# fmt: on
# fairseq 0.12 silently drops a last batch whose size is not a multiple of this (default 8).
EVERY_SENTENCE = ["--required-batch-size-multiple", "1"]


@pytest.fixture(scope="module")
def mt_run(data, tmp_path_factory):
    """(save dir, training output) of 40 updates of moe_transformer_tiny."""
    save_dir = tmp_path_factory.mktemp("mt_checkpoints")
    return save_dir, run_fairseq("train", *train_args(data, save_dir, *TRANSLATION, max_update=40))


@pytest.fixture(scope="module")
def lm_run(lm_data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("lm_checkpoints")
    # Trained in deterministic mode: every op of fairseq's training loop must accept it.
    return save_dir, run_fairseq(
        "train", *train_args(lm_data, save_dir, *LANGUAGE_MODEL, "--moe-deterministic", max_update=40)
    )


def expert_loads(record):
    """{layer: [share of expert 0, 1, ...]} from one json log record."""
    loads = {}
    for key, value in record.items():
        match = re.fullmatch(r"moe_load_(\w+?)_e(\d+)", key)
        if match:
            loads.setdefault(match.group(1), {})[int(match.group(2))] = float(value)
    return {layer: [shares[e] for e in sorted(shares)] for layer, shares in loads.items()}


def hypotheses(output):
    return [line for line in output.splitlines() if line.startswith("H-")]


def test_moe_translation_training_lowers_the_loss_and_logs_moe_metrics(mt_run):
    _, output = mt_run
    assert_loss_falls(output)
    last = json_logs(output)[-1]
    for key in ("moe_gate_loss", "moe_z_loss", "moe_dropped_frac", "moe_router_entropy", "moe_imbalance"):
        assert key in last, f"{key} missing from {sorted(last)}"
    # moe_transformer_tiny: 2+2 layers, --moe-freq 2 makes layer 1 of each side an MoE layer of 4 experts.
    loads = expert_loads(last)
    assert sorted(loads) == ["dec1", "enc1"]
    for layer, shares in loads.items():
        assert len(shares) == 4
        assert sum(shares) == pytest.approx(1.0, abs=0.01), f"{layer}: shares of slots must sum to 1"
    assert float(last["moe_dropped_frac"]) == 0, "the default capacity factor 0 is dropless"


def test_generate_translates_every_test_sentence_and_reports_bleu(data, mt_run):
    save_dir, _ = mt_run
    output = run_fairseq(
        "generate",
        data,
        "--user-dir",
        USER_DIR,
        "--path",
        save_dir / "checkpoint_best.pt",
        "--cpu",
        "--beam",
        "2",
        "--batch-size",
        "16",
        *EVERY_SENTENCE,
    )
    assert len(hypotheses(output)) == SPLITS["test"]
    assert re.search(r"^Generate test with beam=2: BLEU4 = \d+\.\d+", output, re.M), output[-2000:]


def test_interactive_translates_each_input_line(data, mt_run):
    save_dir, _ = mt_run
    output = run_fairseq(
        "interactive",
        data,
        "--user-dir",
        USER_DIR,
        "--path",
        save_dir / "checkpoint_best.pt",
        "--cpu",
        "--source-lang",
        "src",
        "--target-lang",
        "tgt",
        "--beam",
        "2",
        input="s1 s2 s3\ns5 s9 s11 s20 s7\n",
    )
    assert [h.split("\t")[0] for h in hypotheses(output)] == ["H-0", "H-1"]


def test_moe_language_model_training_lowers_the_loss_and_logs_expert_load(lm_run):
    _, output = lm_run
    assert_loss_falls(output)
    last = json_logs(output)[-1]
    assert "moe_gate_loss" in last
    assert sorted(expert_loads(last)) == ["dec1"]
    assert "--moe-deterministic: torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8" in output


def test_eval_lm_reports_the_perplexity_of_a_trained_moe_language_model(lm_data, lm_run):
    save_dir, train_output = lm_run
    output = run_fairseq(
        "eval_lm",
        lm_data,
        "--user-dir",
        USER_DIR,
        "--path",
        save_dir / "checkpoint_best.pt",
        "--cpu",
        "--tokens-per-sample",
        "64",
        "--max-tokens",
        "512",
        *EVERY_SENTENCE,
    )
    match = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", output)
    assert match, output[-2000:]
    # Guessing among the 40 words would score 40; the corpus is predictable after two tokens.
    assert float(match.group(2)) < 10


def test_hydra_train_runs_the_packaged_yaml_config_in_place_with_command_line_overrides(lm_data, tmp_path):
    output = run_fairseq(
        "hydra_train",
        "--config-dir",
        CONFIG_DIR,
        "--config-name",
        "moe_lm_tiny",
        f"common.user_dir={USER_DIR}",
        f"task.data={lm_data}",
        "model.moe_expert_count=2",
        cwd=tmp_path,
    )
    assert_loss_falls(output)
    last = json_logs(output)[-1]
    assert last["num_updates"] == "40", "max_update comes from the YAML file"
    assert [len(shares) for shares in expert_loads(last).values()] == [2], "the override reaches the model"
    # The relative save_dir of the YAML lands in the working directory, not in a hydra outputs/ dir.
    assert (tmp_path / "checkpoints" / "checkpoint_best.pt").is_file()


def test_training_resumes_from_checkpoint_last_under_weights_only_loading(data, mt_run, tmp_path):
    first_save_dir, first_output = mt_run
    save_dir = tmp_path / "checkpoints"
    shutil.copytree(first_save_dir, save_dir)
    output = run_fairseq("train", *train_args(data, save_dir, *TRANSLATION, max_update=50))
    assert re.search(r"Loaded checkpoint \S*checkpoint_last\.pt \(epoch \d+ @ 40 updates\)", output), output[-3000:]
    records = json_logs(output)
    assert [r["num_updates"] for r in records] == ["45", "50"]
    # Continued, not restarted: the loss picks up where the first run left off.
    assert logged_losses(output)[0] < 0.85 * logged_losses(first_output)[0]


class OpensAFile:
    """Unpickling this calls ``open(path, "w")``: it stands for any code a checkpoint could run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def smuggle(checkpoint, payload, tampered):
    """Write ``checkpoint`` again as ``tampered`` with ``payload`` pickled inside it."""
    # The test trusts the file it just trained, hence weights_only=False here and only here.
    state = torch.load(checkpoint, weights_only=False)
    state["extra_state"]["smuggled"] = payload
    torch.save(state, tampered)


def assert_refused(output, file_name, named):
    last_line = output.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"\S+\.py: error: refusing to load \S*{re.escape(file_name)}: it pickles {re.escape(named)}, .*",
        last_line,
    ), output[-2000:]
    assert "Weights only load failed" not in output, "torch's multi-line message should be replaced"


@pytest.mark.parametrize(
    "make_payload, named",
    [
        (lambda tmp_path: fractions.Fraction(1, 3), "fractions.Fraction"),
        (lambda tmp_path: OpensAFile(tmp_path / "code_ran"), "io.open"),  # builtins.open pickles as io.open
    ],
    ids=["plain_object", "code_payload"],
)
def test_generate_refuses_a_checkpoint_that_pickles_a_disallowed_object(data, mt_run, tmp_path, make_payload, named):
    save_dir, _ = mt_run
    tampered = tmp_path / "tampered.pt"
    smuggle(save_dir / "checkpoint_best.pt", make_payload(tmp_path), tampered)
    output = run_fairseq(
        "generate",
        data,
        "--user-dir",
        USER_DIR,
        "--path",
        tampered,
        "--cpu",
        expect_failure=True,
    )
    assert_refused(output, "tampered.pt", named)
    assert not (tmp_path / "code_ran").exists(), "unpickling ran code from the checkpoint"


def test_resuming_refuses_a_checkpoint_last_that_pickles_a_disallowed_object(data, mt_run, tmp_path):
    first_save_dir, _ = mt_run
    save_dir = tmp_path / "checkpoints"
    save_dir.mkdir()
    smuggle(first_save_dir / "checkpoint_last.pt", fractions.Fraction(1, 3), save_dir / "checkpoint_last.pt")
    output = run_fairseq("train", *train_args(data, save_dir, *TRANSLATION, max_update=50), expect_failure=True)
    assert_refused(output, "checkpoint_last.pt", "fractions.Fraction")
