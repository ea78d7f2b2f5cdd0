"""``import-hf`` of the hub's NLLB-MoE layout as its producers write it: transformers' own converter (the code that
wrote ``facebook/nllb-moe-54b``; tests/support/oracles/nllb_moe_converter.py says how it is run) over a tiny set in
the ``nllb`` branch's layout, and ``NllbMoeModel.save_pretrained(safe_serialization=False)``: base-model names
(no ``model.`` prefix, ``shared.weight``, no ``lm_head``), ``config.json`` architectures ``NllbMoeModel``,
``pytorch_model-000NN-of-000MM.bin`` shards with their index, some experts of every MoE layer in each shard.

The imported set computes the logits transformers computes from those files (``from_pretrained``) within 1e-5,
and fairseq-generate finds transformers' ``generate`` hypotheses; each shard is read once for all output files
(the reads counted: no byte read twice, every tensor's bytes read)."""

import json

import pytest
import torch

from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.inputs.branch_sets import write_branch_parts
from support.oracles.hf_generation import assert_same_searches, eos_leaning_model, preprocessed
from support.oracles.hf_nllb_moe import (
    EXPERTS,
    NEEDS_TRANSFORMERS,
    assert_same_as_hf,
    batch,
    branch_options,
    branch_state,
    hf_config,
    hf_model,
    oracle_task,
)
from support.oracles.nllb_moe_converter import convert
from support.oracles.read_counts import assert_each_byte_read_once, counted_reads

pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema", "ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(the converter's output directory, transformers' model loaded from it, the dictionary's directory, the
    binarised sources, the target dictionary). The converter reads the branch set's E rank files, each holding
    one expert under local number 0 (as NLLB-200 MoE's ranks 0..127), and its shared file."""
    from fairseq.data import Dictionary
    from transformers import NllbMoeForConditionalGeneration

    root = tmp_path_factory.mktemp("hub")
    data, data_bin = preprocessed(root)
    source = eos_leaning_model()
    shared, experts = branch_state(source)
    options = branch_options(data, use_moe_pad_mask=True)
    prefix = write_branch_parts(root / "model_moe_54b" / "checkpoint_2_300000", shared, experts, options, EXPERTS)
    # the hub's config.json: NllbMoeConfig's defaults (expert_capacity 64) over the dense model's shape
    out = convert(prefix, root / "hf-converted-moe", hf_config(expert_capacity=64), max_shard_size="8KB")
    config = json.loads((out / "config.json").read_text())
    names = json.loads((out / "pytorch_model.bin.index.json").read_text())["weight_map"]
    assert config["architectures"] == ["NllbMoeModel"] and "shared.weight" in names
    assert not any(n.startswith("model.") or n.startswith("lm_head") for n in names)
    layer = "encoder.layers.1.ffn.experts"
    assert len({names[f"{layer}.expert_{j}.fc1.weight"] for j in range(EXPERTS)}) > 1, "one layer's experts, one shard"
    assert not list(out.glob("*.safetensors")) and len(set(names.values())) > 8
    hf = NllbMoeForConditionalGeneration.from_pretrained(str(out)).eval()
    return out, hf, data, data_bin, Dictionary.load(str(data / "dict.tgt.txt"))


def imported(hf_dir, out, world):
    out.mkdir()
    assert checkpoint_tool(["import-hf", str(hf_dir), str(out / "ck.pt"), "--world-size", str(world)]) == 0
    return out / "ck.pt"


@pytest.mark.parametrize("world", [1, 2])
def test_the_converters_output_imports_reading_each_shard_once_with_hfs_logits(hub, tmp_path, monkeypatch, world):
    from fairseq import checkpoint_utils

    hf_dir, hf, *_ = hub
    reads = counted_reads(monkeypatch)
    path = imported(hf_dir, tmp_path / "ours", world)
    assert_each_byte_read_once(reads, hf_dir)
    task = oracle_task(tmp_path / "dict")
    model = checkpoint_utils.load_model_ensemble([str(path)], task=task)[0][0].eval()
    assert_same_as_hf(model, hf, *batch([7, 7, 7], [6, 6, 6]))
    assert_same_as_hf(model, hf, *batch([11], [5], seed=1))


def test_fairseq_generate_on_the_converters_output_finds_hfs_generate_hypotheses(hub, tmp_path):
    hf_dir, hf, _, data_bin, dictionary = hub
    path = imported(hf_dir, tmp_path / "ours", 2)
    assert_same_searches(data_bin, path, hf, tmp_path / "results", dictionary)


def test_an_nllb_moe_model_saved_as_bin_shards_imports_with_the_logits_of_hf(tmp_path):
    """``NllbMoeModel.save_pretrained`` (the base model: no prefix, no lm_head) in several .bin shards."""
    from fairseq import checkpoint_utils

    hf = hf_model()
    hf.model.save_pretrained(str(tmp_path / "hf"), safe_serialization=False, max_shard_size="40KB")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["NllbMoeModel"] and len(list((tmp_path / "hf").glob("*.bin"))) > 2
    path = imported(tmp_path / "hf", tmp_path / "ours", 2)
    model = checkpoint_utils.load_model_ensemble([str(path)], task=oracle_task(tmp_path / "dict"))[0][0].eval()
    assert_same_as_hf(model, hf, *batch([7, 7, 7], [6, 6, 6]))


def test_names_with_and_without_the_model_prefix_in_one_directory_are_refused(tmp_path, capsys):
    hf = hf_model()
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=False)
    state = torch.load(tmp_path / "hf" / "pytorch_model.bin", weights_only=True)
    name = "model.encoder.layers.0.self_attn.k_proj.weight"
    state[name[len("model.") :]] = state[name].clone()
    torch.save(state, tmp_path / "hf" / "pytorch_model.bin")
    assert checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds both" in err and "k_proj" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out.pt").exists()


def test_a_config_of_another_architecture_is_refused_in_one_line(tmp_path, capsys):
    hf = hf_model()
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "architectures": ["NllbMoeForCausalLM"]}))
    assert checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "architectures ['NllbMoeForCausalLM']" in err and "NllbMoeModel" in err and len(err.splitlines()) == 1
