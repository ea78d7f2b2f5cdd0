"""Generation through the Hugging Face exchange: ``export-hf`` and ``import-hf`` keep what the two searches find.

fairseq-generate (``fairseq_cli.generate``'s own main, in this process) and HF's
``NllbMoeForConditionalGeneration.generate`` run as the same search (``tests/support/oracles/hf_generation.py`` lists
the settings: decoder_start_token_id eos, pad suppressed, min_new_tokens 1, early_stopping True,
length_penalty = --lenpen 1, fairseq's forced eos at the maximum length), greedy and with 4 beams:

- a set this plugin holds (imported from a random HF model by ``import-fairseq-moe``) -> ``export-hf`` ->
  ``from_pretrained``: HF's generate gives fairseq-generate's tokens on the original set, and beam scores
  within 1e-5;
- a random NllbMoe saved by transformers' ``save_pretrained`` -> ``import-hf`` (one file, and 2 rank files
  loaded by one process) -> fairseq-generate gives HF's generate's tokens and beam scores on that model."""

import pytest

from support.oracles.hf_generation import assert_same_searches, eos_leaning_model, import_from_hf, preprocessed
from support.oracles.hf_nllb_moe import NEEDS_TRANSFORMERS

# slow: each case builds Hugging Face NllbMoe and fairseq models end to end, about 7 s of CPU for its
# 3 cases (7 Dec 2026): too much for the fast tier (--fast) run after every edit.
pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.slow,
    pytest.mark.filterwarnings(
        "ignore:\\s*'config' is validated against ConfigStore schema",
        "ignore::UserWarning",
        "ignore::DeprecationWarning",
    ),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the dictionary's directory, the binarised SOURCES, the eos-leaning HF model, the target dictionary)."""
    from fairseq.data import Dictionary

    root = tmp_path_factory.mktemp("generate")
    data, data_bin = preprocessed(root)
    return data, data_bin, eos_leaning_model(), Dictionary.load(str(data / "dict.tgt.txt"))


def checkpoint_tool(*argv):
    from fairseq_moe_ext.checkpoint.__main__ import main

    assert main([str(a) for a in argv]) == 0, argv


def test_hf_generate_on_an_exported_set_gives_fairseq_generates_tokens_and_scores(setup, tmp_path):
    data, data_bin, hf, dictionary = setup
    original = import_from_hf(tmp_path, hf, data)
    checkpoint_tool("export-hf", original, tmp_path / "hf", "--max-shard-size", "40KB")
    from transformers import NllbMoeForConditionalGeneration

    exported = NllbMoeForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    assert_same_searches(data_bin, original, exported, tmp_path / "results", dictionary)


@pytest.mark.parametrize("world", [1, 2], ids=["one-file", "two-rank-files"])
def test_fairseq_generate_on_an_import_hf_set_gives_hf_generates_tokens_and_scores(setup, tmp_path, world):
    _, data_bin, hf, dictionary = setup
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True, max_shard_size="40KB")
    (tmp_path / "ours").mkdir()
    checkpoint_tool("import-hf", tmp_path / "hf", tmp_path / "ours" / "ck.pt", "--world-size", world)
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert files == (["ck.pt"] if world == 1 else ["ck-rank-0-of-2.pt", "ck-rank-1-of-2.pt", "ck.set.json"])
    assert_same_searches(data_bin, tmp_path / "ours" / "ck.pt", hf, tmp_path / "results", dictionary)
