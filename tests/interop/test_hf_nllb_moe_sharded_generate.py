"""Generation from an NLLB-MoE set imported for 2 workers, with each worker holding half of the experts: greedy
and beam search (4 beams, length penalty 1) on 2 torchrun workers over gloo give the tokens, and for beam search
the scores, of Hugging Face's ``NllbMoeForConditionalGeneration.generate`` (transformers 4.57.1, the oracle) on
the HF model the set was written from, set up as the same search (``tests/support/oracles/hf_generation.py``).

One torchrun launch serves both searches: each worker runs fairseq-generate's own entry point twice
(``tests/support/probes/fairseq_generate_probe.py``), which also records the experts each worker's model held.
"""

import json
import re

import pytest
import torch

from support.inputs.branch_sets import BRANCH_NAME, OUR_EXPERT
from support.launch.fairseq_helpers import torchrun
from support.launch.paths import PROBES
from support.oracles.hf_generation import (
    BEAM,
    SOURCES,
    eos_leaning_model,
    generate_args,
    hf_generate,
    hypotheses,
    import_from_hf,
    preprocessed,
    search_args,
)
from support.oracles.hf_nllb_moe import EXPERTS, NEEDS_TRANSFORMERS

pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore"),
]
PROBE = PROBES / "fairseq_generate_probe.py"
RUNS = {"greedy": search_args(1), "beam": search_args(BEAM, 1.0)}


def test_sharded_generation_on_two_workers_gives_hf_greedy_and_beam_tokens(tmp_path):
    from fairseq.data import Dictionary

    data, data_bin = preprocessed(tmp_path)
    hf = eos_leaning_model()
    path = import_from_hf(tmp_path, hf, data, world=2)
    assert sorted(p.name for p in tmp_path.glob("imported-rank-*.pt")) == [f"imported-rank-{r}-of-2.pt" for r in (0, 1)]
    out = tmp_path / "out"
    # 3 sentences a batch: one batch for each worker.
    args = [*generate_args(data_bin, path), "--batch-size", "3"]
    output = torchrun(2, PROBE, [out, json.dumps(RUNS), *args], timeout=240)
    for r in (0, 1):
        assert re.search(rf"expert-sharded inference: worker {r} of 2 holds experts {2 * r}\.\.{2 * r + 1}\b", output)
    dictionary = Dictionary.load(str(data / "dict.tgt.txt"))
    hf_state = hf.state_dict()
    hf_runs = {name: hf_generate(hf, int(flags[1]), 1.0) for name, flags in RUNS.items()}
    assert hf_runs["greedy"][0] != hf_runs["beam"][0], "beam and greedy search agree: the beam run proves nothing more"
    for name, (theirs, scores) in hf_runs.items():
        ours = {}
        for r in (0, 1):
            found = hypotheses((out / name / f"rank{r}" / "generate-test.txt").read_text(), dictionary)
            assert found and not ours.keys() & found.keys(), f"{name}: worker {r} generated nothing, or twice"
            ours.update(found)
            # The model each worker generated with held experts 2r and 2r+1 of each MoE layer, HF's.
            experts = torch.load(out / name / f"rank{r}.pt")
            assert len(experts) == 2 * 4  # 2 MoE layers (encoder's, decoder's) x fc1/fc2 weight/bias
            for key, tensor in experts.items():
                match = OUR_EXPERT.match(key)
                assert tensor.shape[0] == EXPERTS // 2, (name, r, key, tuple(tensor.shape))
                for j in range(EXPERTS // 2):
                    hf_key = f"model.{match['layer']}.ffn.experts.expert_{2 * r + j}.{BRANCH_NAME[match['name']]}"
                    assert torch.equal(tensor[j], hf_state[hf_key]), (name, r, key, j)
        assert sorted(ours) == list(range(len(SOURCES)))
        assert [ours[i]["tokens"] for i in range(len(SOURCES))] == theirs, name
        if name == "beam":
            assert [ours[i]["score"] for i in range(len(SOURCES))] == pytest.approx(scores, abs=1e-5)
