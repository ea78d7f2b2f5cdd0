"""Hugging Face's ``NllbMoeForConditionalGeneration`` (transformers 4.57.1, tests/requirements-oracle.txt) as the
oracle for ``import-fairseq-moe``: a tiny random HF model is written in the fairseq ``nllb`` branch's file layout
(tests/support/hf_nllb_moe.py), imported, loaded with fairseq's ``checkpoint_utils`` into this plugin's
``moe_transformer``, and must compute HF's encoder outputs and decoder logits within 1e-5 (fp32, eval)."""

import re
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

transformers = pytest.importorskip("transformers", reason="transformers (tests/requirements-oracle.txt) is not "
                                   "installed: bash tests/run.sh installs it into the test venv")

from branch_sets import write_branch_parts  # noqa: E402
from fairseq_helpers import USER_DIR  # noqa: E402
from hf_nllb_moe import EXPERTS, VOCAB, branch_options, branch_state, hf_model, write_dictionary  # noqa: E402
from fairseq_moe_ext.checkpoint import branch_import  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
REPO = Path(__file__).resolve().parents[2]
PAD, EOS = 1, 2
TOLERANCE = dict(atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    data = write_dictionary(tmp_path_factory.mktemp("hf_oracle_dict"))
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
        "--arch", "transformer", "--cpu"])
    built = tasks.setup_task(convert_namespace_to_omegaconf(args).task)
    built.data_dir = data
    return built


def batch(lengths, target_lengths=None, seed=0):
    """Source left-padded and target right-padded, as fairseq collates them; eos ends every source and
    starts every decoder input (NLLB's decoder_start_token_id is eos)."""
    g = torch.Generator().manual_seed(seed)
    target_lengths = target_lengths or lengths
    src = torch.full((len(lengths), max(lengths)), PAD)
    tgt = torch.full((len(lengths), max(target_lengths)), PAD)
    for row, (n, m) in enumerate(zip(lengths, target_lengths)):
        src[row, src.shape[1] - n:] = torch.cat([torch.randint(4, VOCAB, (n - 1,), generator=g), torch.tensor([EOS])])
        tgt[row, :m] = torch.cat([torch.tensor([EOS]), torch.randint(4, VOCAB, (m - 1,), generator=g)])
    return src, tgt


def import_hf(tmp_path, task, hf, ranks=2, world=1, **branch_moe):
    """hf -> the branch's layout (``ranks`` rank files) -> import-fairseq-moe (``world`` output files) ->
    fairseq's load_model_ensemble, in eval; returns (model, what the import printed)."""
    shared, experts = branch_state(hf)
    prefix = write_branch_parts(tmp_path / "nllb" / "checkpoint_2_300000", shared, experts,
                                branch_options(task.data_dir, **branch_moe), ranks)
    lines = []
    branch_import.import_branch_set(str(prefix), str(tmp_path / "imported.pt"), world, report=lines.append)
    models, _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "imported.pt")], task=task)
    return models[0].eval(), "\n".join(lines)


def outputs_of_both(model, hf, src, tgt):
    """(ours, HF's) encoder outputs [B, S, C] and logits [B, T, V], pad positions zeroed in both."""
    with torch.no_grad():
        lengths = src.ne(PAD).sum(1)
        encoder = model.encoder(src, lengths)["encoder_out"][0].transpose(0, 1)
        logits = model(src, lengths, tgt)[0]
        theirs = hf(input_ids=src, attention_mask=src.ne(PAD).long(), decoder_input_ids=tgt,
                    decoder_attention_mask=tgt.ne(PAD).long())
    real_src, real_tgt = src.ne(PAD).unsqueeze(-1), tgt.ne(PAD).unsqueeze(-1)
    return ((encoder * real_src, logits * real_tgt),
            (theirs.encoder_last_hidden_state * real_src, theirs.logits * real_tgt))


def assert_same_as_hf(model, hf, src, tgt):
    (encoder, logits), (hf_encoder, hf_logits) = outputs_of_both(model, hf, src, tgt)
    torch.testing.assert_close(encoder, hf_encoder, **TOLERANCE)
    torch.testing.assert_close(logits, hf_logits, **TOLERANCE)


def test_the_installed_transformers_is_the_pinned_one_and_users_never_install_it():
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
