"""Hugging Face's ``NllbMoeForConditionalGeneration`` (transformers 4.57.1, tests/requirements-oracle.txt) as the
oracle for ``import-fairseq-moe``: a tiny random HF model is written in the fairseq ``nllb`` branch's file layout
(tests/support/oracles/hf_nllb_moe.py), imported, loaded with fairseq's ``checkpoint_utils`` into this plugin's
``moe_transformer``, and must compute HF's encoder outputs and decoder logits within 1e-5 (fp32, eval)."""

import re
from pathlib import Path

import pytest
import torch

from support.oracles.hf_nllb_moe import (
    EXPERTS,
    NEEDS_TRANSFORMERS,
    assert_same_as_hf,
    batch,
    hf_model,
    import_hf,
    oracle_task,
)

pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema"),
]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return oracle_task(tmp_path_factory.mktemp("hf_oracle_dict"))


def test_the_installed_transformers_is_the_pinned_one_and_users_never_install_it():
    import transformers

    pinned = re.search(r"^transformers==(\S+)$", (REPO / "tests" / "requirements-oracle.txt").read_text(), re.M)
    assert pinned and transformers.__version__ == pinned.group(1) == "4.57.1"
    assert "transformers" not in (REPO / "setup.py").read_text() + (REPO / "requirements.txt").read_text()


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_the_oracle_runs_every_expert_zeroing_any_one_changes_hf_logits(side):
    # transformers 5.2x ran every token through experts 0 and 1 only: there, zeroing 2 or 3 changed nothing.
    hf = hf_model()
    src, tgt = batch([9, 9, 9, 9])
    with torch.no_grad():
        reference = hf(input_ids=src, decoder_input_ids=tgt).logits
        for expert in range(EXPERTS):
            fc2 = getattr(hf.model, side).layers[1].ffn.experts[f"expert_{expert}"].fc2
            saved = fc2.weight.clone(), fc2.bias.clone()
            fc2.weight.zero_(), fc2.bias.zero_()
            changed = (hf(input_ids=src, decoder_input_ids=tgt).logits - reference).abs().max()
            fc2.weight.copy_(saved[0]), fc2.bias.copy_(saved[1])
            assert changed > 1e-3, f"{side} expert {expert}: no token reached it, or HF skipped it"


@pytest.mark.parametrize("ranks, world", [(2, 1), (4, 2), (8, 1)], ids=["2-rank-files", "into-2-workers", "replicas"])
def test_an_hf_model_in_the_nllb_layout_imports_to_hf_encoder_outputs_and_logits(tmp_path, task, ranks, world):
    hf = hf_model()
    model, _ = import_hf(tmp_path, task, hf, ranks=ranks, world=world)
    assert_same_as_hf(model, hf, *batch([7, 7, 7], [6, 6, 6]))
    assert_same_as_hf(model, hf, *batch([11], [5], seed=1))


def test_with_padding_and_nothing_dropped_the_imported_model_computes_hf_outputs(tmp_path, task):
    # HF counts pad tokens in S (its capacity) and leaves them out of routing by its attention mask; this
    # plugin neither routes nor counts them: with nothing dropped (fraction 1) both give the same outputs.
    hf = hf_model()
    model, _ = import_hf(tmp_path, task, hf, use_moe_pad_mask=True)
    assert_same_as_hf(model, hf, *batch([7, 3, 5, 9], [4, 8, 2, 6]))
