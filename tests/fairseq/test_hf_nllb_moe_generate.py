"""Greedy generation from an imported set: ``fairseq-generate``'s own main (``fairseq_cli.generate``, run in this
process, one process) with this plugin, and Hugging Face's ``NllbMoeForConditionalGeneration.generate`` on the HF
model the set was written from (num_beams 1, decoder_start_token_id eos, the pad token suppressed as fairseq's
generator does), produce the same tokens."""

import pytest
import torch

pytest.importorskip(
    "transformers",
    reason="transformers (tests/requirements-oracle.txt) is not installed: "
    "bash tests/run.sh installs it into the test venv",
)

from fairseq import options  # noqa: E402
from fairseq_helpers import USER_DIR  # noqa: E402
from hf_nllb_moe import EOS, PAD, branch_options, branch_state, hf_model, write_dictionary  # noqa: E402
from branch_sets import write_branch_parts  # noqa: E402
from fairseq_moe_ext.checkpoint import branch_import  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
SOURCES = ["w5 w9 w17 w40 w22 w8", "w30 w4", "w11 w12 w13 w14", "w44 w6 w19 w27 w33 w21 w9 w10"]
MAX_NEW = 12


def preprocessed(tmp_path):
    from fairseq_cli import preprocess

    data = write_dictionary(tmp_path / "dict")
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "test.src").write_text("".join(f"{s}\n" for s in SOURCES))
    (raw / "test.tgt").write_text("".join("w4\n" for _ in SOURCES))
    preprocess.main(
        options.get_preprocessing_parser().parse_args(
            [
                "--source-lang",
                "src",
                "--target-lang",
                "tgt",
                f"--testpref={raw / 'test'}",
                f"--destdir={tmp_path / 'bin'}",
                f"--srcdict={data / 'dict.src.txt'}",
                f"--tgtdict={data / 'dict.tgt.txt'}",
                "--workers=1",
            ]
        )
    )
    return data, tmp_path / "bin"


def fairseq_generate(data_bin, path, results):
    from fairseq_cli import generate

    generate.main(
        options.parse_args_and_arch(
            options.get_generation_parser(),
            [
                str(data_bin),
                "--path",
                str(path),
                "--user-dir",
                USER_DIR,
                "--task",
                "translation",
                "--source-lang",
                "src",
                "--target-lang",
                "tgt",
                "--gen-subset",
                "test",
                "--beam",
                "1",
                "--max-len-a",
                "0",
                "--max-len-b",
                str(MAX_NEW),
                "--batch-size",
                "4",
                "--required-batch-size-multiple",
                "1",
                "--num-workers",
                "0",
                "--cpu",
                "--results-path",
                str(results),
            ],
        )
    )
    hypotheses, lengths = {}, {}
    for line in (results / "generate-test.txt").read_text().splitlines():
        if line.startswith("H-"):
            key, _, text = line.split("\t")
            hypotheses[int(key[2:])] = text.split()
        if line.startswith("P-"):  # one positional score per generated token, <s> and the final eos included
            key, scores = line.split("\t")
            lengths[int(key[2:])] = len(scores.split())
    return [hypotheses[i] for i in range(len(SOURCES))], [lengths[i] for i in range(len(SOURCES))]


def hf_generate(hf):
    rows = [[int(w[1:]) for w in s.split()] + [EOS] for s in SOURCES]
    width = max(map(len, rows))
    src = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])  # left-padded, as fairseq batches sources
    with torch.no_grad():
        out = hf.generate(
            input_ids=src,
            attention_mask=src.ne(PAD).long(),
            num_beams=1,
            do_sample=False,
            decoder_start_token_id=EOS,
            max_new_tokens=MAX_NEW,
            suppress_tokens=[PAD],
        )
    hypotheses = []
    for row in out.tolist():
        tokens = row[1:]  # after decoder_start_token_id
        if EOS in tokens:
            tokens = tokens[: tokens.index(EOS)]
        hypotheses.append(tokens)
    return hypotheses


def test_greedy_fairseq_generate_on_an_imported_set_gives_hf_generates_tokens(tmp_path):
    data, data_bin = preprocessed(tmp_path)
    hf = hf_model()
    shared, experts = branch_state(hf)
    prefix = write_branch_parts(
        tmp_path / "nllb" / "checkpoint_2_300000", shared, experts, branch_options(data, use_moe_pad_mask=True), 2
    )
    branch_import.import_branch_set(str(prefix), str(tmp_path / "imported.pt"), 1, report=lambda line: None)
    ours, lengths = fairseq_generate(data_bin, tmp_path / "imported.pt", tmp_path / "results")
    from fairseq.data import Dictionary

    dictionary = Dictionary.load(str(data / "dict.tgt.txt"))
    theirs = hf_generate(hf)
    # fairseq stops at eos or, after MAX_NEW tokens, ends the hypothesis with a forced eos; its H- lines leave
    # out eos and <s> (Dictionary.string), which this random model does generate: the P- lines count them.
    assert lengths == [len(row) + 1 for row in theirs]
    assert ours == [[dictionary[t] for t in row if t != dictionary.bos()] for row in theirs]
    assert any(dictionary.bos() in row for row in theirs)  # so the P- line check above is not vacuous
    assert len({tuple(h) for h in ours}) > 1, "every sentence generated the same tokens: the test tests little"
