"""fairseq-generate and Hugging Face's ``generate`` set up as the same search, on an NLLB-MoE set imported from a
tiny random HF model (``hf_nllb_moe.py``, written in the ``nllb`` branch's layout, imported with
``import-fairseq-moe``).

The settings under which the two searches are one (transformers 4.57.1's ``_beam_search`` and fairseq 0.12.3's
``SequenceGenerator``, both read):

- ``decoder_start_token_id`` eos, as fairseq starts every hypothesis;
- the pad token suppressed (``suppress_tokens``), as fairseq's generator sets its log-probability to -inf;
- ``min_new_tokens=1``: fairseq's ``--min-len`` (default 1) bans eos at the first step;
- ``early_stopping=True``: fairseq finishes a sentence once it has ``beam`` finished hypotheses; HF's default
  (False) and ``"never"`` go on looking for better ones, which with a length penalty above 0 picks longer
  hypotheses than fairseq does;
- ``length_penalty`` = ``--lenpen``: both divide the summed log-probabilities by length ** penalty with a length
  counting the final eos (fairseq ``step + 1``, HF ``cur_len + 1 - decoder_prompt_len``), so any value agrees;
- the maximum length: with ``--max-len-a 0 --max-len-b N`` fairseq generates at most N tokens and then forces
  eos, scored with its own log-probability; HF generates ``max_new_tokens=N + 1`` with ``FairseqMaxLength``
  below. HF's own ``forced_eos_token_id`` scores the forced eos 0 instead, and ``max_new_tokens=N`` alone ends a
  hypothesis at N tokens without eos: same tokens here, other scores, so rankings can differ.
"""

import math
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import torch

from support.inputs.branch_sets import write_branch_parts
from support.launch.fairseq_helpers import USER_DIR
from support.oracles.hf_nllb_moe import EOS, PAD, branch_options, branch_state, hf_model, write_dictionary

SOURCES = [
    "w5 w9 w17 w40 w22 w8",
    "w30 w4",
    "w11 w12 w13 w14",
    "w44 w6 w19 w27 w33 w21 w9 w10",
    "w7 w7 w8 w31 w45",
    "w20 w21 w22 w23 w24 w25 w26",
]
MAX_NEW = 12
BEAM = 4


def source_batch():
    """SOURCES as ids, left-padded (as fairseq batches sources), with eos ending each."""
    rows = [[int(w[1:]) for w in s.split()] + [EOS] for s in SOURCES]
    width = max(map(len, rows))
    return torch.tensor([[PAD] * (width - len(r)) + r for r in rows])


def eos_leaning_model(strength: float = 0.7):
    """``hf_model()`` with eos made likelier (about 1 in 10 per position): its embedding row, which is also the
    output projection's, moved along the decoder's mean output direction, so that some hypotheses end before
    the maximum length and some reach it (a plain random model never ends on its own)."""
    hf = hf_model()
    src = source_batch()
    g = torch.Generator().manual_seed(5)
    tgt = torch.cat(
        [torch.full((len(src), 1), EOS), torch.randint(4, hf.config.vocab_size, (len(src), 10), generator=g)], 1
    )
    with torch.no_grad():
        states = hf.model(input_ids=src, attention_mask=src.ne(PAD).long(), decoder_input_ids=tgt).last_hidden_state
        mean = states.reshape(-1, states.shape[-1]).mean(0)
        hf.model.shared.weight[EOS] += strength * mean / mean.norm()
    return hf


def preprocessed(root: Path):
    """(the dictionary's directory, the binarised test split of SOURCES)."""
    from fairseq_cli import preprocess

    from fairseq import options

    data = write_dictionary(root / "dict")
    raw = root / "raw"
    raw.mkdir(parents=True)
    (raw / "test.src").write_text("".join(f"{s}\n" for s in SOURCES))
    (raw / "test.tgt").write_text("".join("w4\n" for _ in SOURCES))
    preprocess.main(
        options.get_preprocessing_parser().parse_args(
            [
                *("--source-lang", "src", "--target-lang", "tgt", f"--testpref={raw / 'test'}"),
                *(f"--destdir={root / 'bin'}", f"--srcdict={data / 'dict.src.txt'}"),
                *(f"--tgtdict={data / 'dict.tgt.txt'}", "--workers=1"),
            ]
        )
    )
    return data, root / "bin"


def import_from_hf(root: Path, hf, data: Path, world: int = 1) -> Path:
    """hf -> the branch's layout (2 rank files, pad mask on) -> import-fairseq-moe for ``world`` workers."""
    from fairseq_moe_ext.checkpoint.branch import importer as branch_import

    shared, experts = branch_state(hf)
    options = branch_options(data, use_moe_pad_mask=True)
    prefix = write_branch_parts(root / "nllb" / "checkpoint_2_300000", shared, experts, options, 2)
    branch_import.import_branch_set(str(prefix), str(root / "imported.pt"), world, report=lambda line: None)
    return root / "imported.pt"


def generate_args(data_bin: Path, path: Path) -> List[str]:
    """fairseq-generate's command line (without the program and the search's flags, ``search_args``) for the
    search HF's ``hf_generate`` runs."""
    # fmt: off
    return [str(data_bin), "--path", str(path), "--user-dir", USER_DIR, "--task", "translation",
            "--source-lang", "src", "--target-lang", "tgt", "--gen-subset", "test", "--nbest", "1",
            "--max-len-a", "0", "--max-len-b", str(MAX_NEW), "--required-batch-size-multiple", "1",
            "--num-workers", "0", "--cpu"]
    # fmt: on


def search_args(beam: int, lenpen: float = 1.0) -> List[str]:
    return ["--beam", str(beam), "--lenpen", f"{lenpen:g}"]


def fairseq_generate(args: Sequence[str], results: Path) -> str:
    """fairseq_cli.generate's own main on ``args``, in this process; what it wrote."""
    from fairseq_cli import generate

    from fairseq import options

    generate.main(options.parse_args_and_arch(options.get_generation_parser(), [*args, "--results-path", str(results)]))
    return (results / "generate-test.txt").read_text()


def hypotheses(output: str, dictionary) -> Dict[int, dict]:
    """{sentence id: {"tokens": ids without <s>, "score": natural log, "length": tokens with <s> and eos}} from
    fairseq-generate's H- and P- lines (H- leaves <s> and eos out; scores are printed in base 2)."""
    found = {}
    for line in output.splitlines():
        if line.startswith("H-"):
            key, score, text = line.split("\t")
            found.setdefault(int(key[2:]), {}).update(
                tokens=[dictionary.index(w) for w in text.split()], score=float(score) * math.log(2)
            )
        if line.startswith("P-"):
            key, scores = line.split("\t")
            found.setdefault(int(key[2:]), {})["length"] = len(scores.split())
    return found


def fairseq_search(data_bin: Path, path: Path, results: Path, dictionary, beam: int, lenpen: float = 1.0) -> List[dict]:
    """fairseq-generate's ``hypotheses`` on SOURCES, in sentence order, from the search HF's ``hf_generate(hf, beam,
    lenpen)`` runs (6 sentences a batch: one batch)."""
    found = hypotheses(
        fairseq_generate([*generate_args(data_bin, path), *search_args(beam, lenpen), "--batch-size", "6"], results),
        dictionary,
    )
    return [found[i] for i in range(len(found))]


class FairseqMaxLength:
    """An HF logits processor: at the last step of ``max_length`` only eos is allowed, keeping its
    log-probability, as fairseq's generator forces eos at its maximum length."""

    def __init__(self, max_length: int):
        self.max_length = max_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] == self.max_length - 1:
            kept = scores[:, EOS].clone()
            scores = torch.full_like(scores, -math.inf)
            scores[:, EOS] = kept
        return scores


def hf_generate(hf, beam: int, lenpen: float = 1.0):
    """HF's best hypothesis per sentence of SOURCES, without <s> and from eos on, and its score (natural log;
    None for greedy), from ``generate`` set up as fairseq-generate's ``generate_args``."""
    from transformers import LogitsProcessorList

    src = source_batch()
    with torch.no_grad():
        out = hf.generate(
            input_ids=src,
            attention_mask=src.ne(PAD).long(),
            num_beams=beam,
            do_sample=False,
            decoder_start_token_id=EOS,
            suppress_tokens=[PAD],
            min_new_tokens=1,
            max_new_tokens=MAX_NEW + 1,
            logits_processor=LogitsProcessorList([FairseqMaxLength(MAX_NEW + 2)]),
            early_stopping=True,
            length_penalty=lenpen,
            output_scores=True,
            return_dict_in_generate=True,
        )
    best = []
    for row in out.sequences.tolist():
        tokens = row[1:]  # after decoder_start_token_id; eos ends every one (FairseqMaxLength)
        best.append(tokens[: tokens.index(EOS)])
    scores = out.sequences_scores.tolist() if beam > 1 else [None] * len(best)
    return best, scores


def assert_same_searches(data_bin, path, hf, results, dictionary):
    """fairseq-generate on ``path`` and HF's generate on ``hf``, greedy and beam: the same tokens (P- lines
    count the <s> H- lines leave out), the same beam scores, and a search that is tested (hypotheses ending
    before the maximum length and at it, beam search finding what greedy search does not)."""
    found = {}
    for beam in (1, BEAM):
        ours = fairseq_search(data_bin, path, results / f"beam{beam}", dictionary, beam)
        theirs, scores = hf_generate(hf, beam)
        assert [h["length"] for h in ours] == [len(row) + 1 for row in theirs], f"--beam {beam}"
        assert [h["tokens"] for h in ours] == [[t for t in row if t != dictionary.bos()] for row in theirs], beam
        if beam > 1:
            assert [h["score"] for h in ours] == pytest.approx(scores, abs=1e-5)
        lengths = [len(row) for row in theirs]
        assert min(lengths) < MAX_NEW and MAX_NEW in lengths, (beam, lengths)
        found[beam] = theirs
    assert found[1] != found[BEAM], "beam search found greedy search's hypotheses: the beam is untested"
