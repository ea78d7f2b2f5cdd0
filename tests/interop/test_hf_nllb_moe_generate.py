"""Generation from an imported set: ``fairseq-generate``'s own main (``fairseq_cli.generate``, run in this
process, one process) with this plugin, and Hugging Face's ``NllbMoeForConditionalGeneration.generate`` on the HF
model the set was written from, set up as the same search (``tests/support/oracles/hf_generation.py`` lists the
settings: decoder_start_token_id eos, pad suppressed, min_new_tokens 1 for fairseq's --min-len 1,
early_stopping True, length_penalty = --lenpen, fairseq's forced eos at the maximum length), produce the same
tokens: greedy, and beam search (4 beams) with length penalties 0 and 1, whose scores agree too."""

import pytest

from support.oracles.hf_generation import (
    BEAM,
    MAX_NEW,
    eos_leaning_model,
    fairseq_search,
    hf_generate,
    import_from_hf,
    preprocessed,
)
from support.oracles.hf_nllb_moe import NEEDS_TRANSFORMERS, hf_model

pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema"),
]


def generated(data, data_bin, path, results, beam, lenpen=1.0):
    from fairseq.data import Dictionary

    dictionary = Dictionary.load(str(data / "dict.tgt.txt"))
    return fairseq_search(data_bin, path, results, dictionary, beam, lenpen), dictionary


def test_greedy_fairseq_generate_on_an_imported_set_gives_hf_generates_tokens(tmp_path):
    data, data_bin = preprocessed(tmp_path)
    hf = hf_model()
    ours, dictionary = generated(data, data_bin, import_from_hf(tmp_path, hf, data), tmp_path / "results", 1)
    theirs, _ = hf_generate(hf, 1)
    # fairseq stops at eos or, after MAX_NEW tokens, ends the hypothesis with a forced eos; its H- lines leave
    # out eos and <s> (Dictionary.string), which this random model does generate: the P- lines count them.
    assert [h["length"] for h in ours] == [len(row) + 1 for row in theirs]
    assert [h["tokens"] for h in ours] == [[t for t in row if t != dictionary.bos()] for row in theirs]
    assert any(dictionary.bos() in row for row in theirs)  # so the P- line check above is not vacuous
    assert len({tuple(h["tokens"]) for h in ours}) > 1, (
        "every sentence generated the same tokens: the test tests little"
    )


def test_beam_search_on_an_imported_set_gives_hf_best_hypothesis_and_score(tmp_path):
    data, data_bin = preprocessed(tmp_path)
    hf = eos_leaning_model()
    path = import_from_hf(tmp_path, hf, data)
    greedy, _ = hf_generate(hf, 1)
    best = {}
    for lenpen in (0.0, 1.0):
        ours, dictionary = generated(data, data_bin, path, tmp_path / f"lenpen{lenpen:g}", BEAM, lenpen)
        theirs, scores = hf_generate(hf, BEAM, lenpen)
        assert not any(dictionary.bos() in row for row in theirs)  # so H- lines show every token
        assert [h["tokens"] for h in ours] == theirs, f"--lenpen {lenpen:g}"
        assert [h["score"] for h in ours] == pytest.approx(scores, abs=1e-5), f"--lenpen {lenpen:g}"
        lengths = [len(row) for row in theirs]
        # Some hypotheses end on their own and some at the maximum length (fairseq's forced eos), and beam
        # search finds what greedy search does not: the test checks the search, not one path through it.
        assert min(lengths) < MAX_NEW and MAX_NEW in lengths, (lenpen, lengths)
        assert theirs != greedy, f"--lenpen {lenpen:g}: beam search found greedy search's hypotheses"
        best[lenpen] = theirs
    assert best[0.0] != best[1.0], "the length penalty changed no hypothesis: its normalisation is untested"
