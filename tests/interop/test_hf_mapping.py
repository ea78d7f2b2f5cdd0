"""The torch-only half of export-hf / import-hf: safetensors files written and read without the
``safetensors`` package (which reads and writes the other side here, test-only), parameter names and
config.json both ways, and the shard writer's size bound. The model-level checks against transformers'
NllbMoe are tests/interop/test_hf_exchange.py."""

import argparse
import json

import pytest
import torch

from fairseq_moe_ext.checkpoint import CheckpointSetError
from fairseq_moe_ext.checkpoint.hf.config import hf_config, imported_options
from fairseq_moe_ext.checkpoint.hf.exporter import ShardWriter, shard_size
from fairseq_moe_ext.checkpoint.hf.keys import expert_tensor, hf_expert, hf_expert_key, hf_key, our_key
from fairseq_moe_ext.checkpoint.hf.safetensors_file import SafetensorsFile, write_safetensors

safetensors_torch = pytest.importorskip("safetensors.torch")
safetensors = pytest.importorskip("safetensors")


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(4, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "i64": torch.arange(7),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
    }


def test_what_write_safetensors_writes_the_safetensors_package_reads_back_equal(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), tensors().items(), {"format": "pt"})
    back = safetensors_torch.load_file(str(tmp_path / "a.safetensors"))
    assert sorted(back) == sorted(tensors()) and all(
        torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors().items()
    )
    with safetensors.safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_what_the_safetensors_package_writes_is_read_back_one_tensor_at_a_time(tmp_path):
    safetensors_torch.save_file(tensors(), str(tmp_path / "a.safetensors"), metadata={"format": "pt"})
    read = SafetensorsFile(str(tmp_path / "a.safetensors"))
    assert read.metadata == {"format": "pt"} and read.shape("f32") == [3, 5]
    assert all(torch.equal(read.read(k), v) and read.read(k).dtype == v.dtype for k, v in tensors().items())


@pytest.mark.parametrize("keep", [4, 40, -1], ids=["in-the-length", "in-the-header", "in-the-data"])
def test_a_truncated_safetensors_file_is_refused_in_one_line_before_any_tensor_is_read(tmp_path, keep):
    path = tmp_path / "a.safetensors"
    safetensors_torch.save_file(tensors(), str(path))
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CheckpointSetError, match="is not a complete safetensors file") as e:
        SafetensorsFile(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


# fmt: off
OUR_LAYER_KEYS = [
    "encoder.embed_tokens.weight", "encoder.layer_norm.weight", "decoder.layer_norm.bias",
    "encoder.layers.0.self_attn.q_proj.weight", "encoder.layers.0.self_attn_layer_norm.bias",
    "encoder.layers.0.fc1.weight", "encoder.layers.0.fc2.bias", "encoder.layers.1.final_layer_norm.weight",
    "decoder.layers.3.encoder_attn.out_proj.bias", "decoder.layers.3.encoder_attn_layer_norm.weight",
    "decoder.layers.1.fc1.router.wg.weight", "decoder.layers.2.self_attn.v_proj.bias",
]
# fmt: on


def test_every_non_expert_parameter_name_maps_to_nllb_moe_and_back():
    hf = [hf_key(k) for k in OUR_LAYER_KEYS]
    assert hf[0] == "model.shared.weight" and hf[5] == "model.encoder.layers.0.ffn.fc1.weight"
    assert hf[8] == "model.decoder.layers.3.cross_attention.out_proj.bias"
    assert hf[10] == "model.decoder.layers.1.ffn.router.classifier.weight"
    assert hf[7] == "model.encoder.layers.1.ff_layer_norm.weight"
    assert [our_key(k) for k in hf] == OUR_LAYER_KEYS
    assert hf_key("encoder.layers.0.fc1.experts.batched_fc1_w") is None and hf_key("encoder.version") is None


def test_each_expert_of_a_stacked_tensor_gets_its_own_nllb_moe_name_and_comes_back():
    layer, name = expert_tensor("decoder.layers.1.fc1.experts.batched_fc2_w")
    assert hf_expert_key(layer, name, 5) == "model.decoder.layers.1.ffn.experts.expert_5.fc2.weight"
    assert hf_expert("model.decoder.layers.1.ffn.experts.expert_5.fc2.weight") == (layer, name, 5)
    assert expert_tensor("decoder.layers.1.fc1.router.wg.weight") is None


def options(**changes):
    base = dict(
        arch="moe_transformer",
        encoder_layers=3,
        decoder_layers=2,
        encoder_embed_dim=16,
        decoder_embed_dim=16,
        encoder_ffn_embed_dim=40,
        decoder_ffn_embed_dim=24,
        encoder_attention_heads=2,
        decoder_attention_heads=4,
        share_all_embeddings=True,
        encoder_normalize_before=True,
        decoder_normalize_before=True,
        moe_expert_count=8,
        moe_top_k=2,
        moe_normalize_gate=True,
        moe_capacity_factor=1.0,
        moe_eval_capacity_factor=0.0,
        moe_freq=2,
        encoder_moe_freq=1,
        decoder_moe_freq=None,
        moe_eom=0.1,
        activation_fn="gelu",
        dropout=0.3,
        attention_dropout=0.2,
        activation_dropout=0.1,
        no_scale_embedding=True,
        max_source_positions=256,
        max_target_positions=512,
        moe_batch_prioritized_routing=True,
    )
    return argparse.Namespace(**{**base, **changes})


def test_config_json_carries_every_option_nllb_moe_has_and_import_reads_them_back():
    config, notes = hf_config(options(), "ck.pt", vocab=30, dtype="float32")
    assert (
        config["d_model"],
        config["encoder_layers"],
        config["decoder_attention_heads"],
        config["encoder_ffn_dim"],
        config["decoder_ffn_dim"],
        config["num_experts"],
        config["encoder_sparse_step"],
        config["decoder_sparse_step"],
    ) == (16, 3, 4, 40, 24, 8, 1, 2)
    assert (
        config["moe_token_dropout"],
        config["activation_function"],
        config["scale_embedding"],
        config["max_position_embeddings"],
        config["vocab_size"],
        config["batch_prioritized_routing"],
        config["moe_eval_capacity_token_fraction"],
        config["expert_capacity"],
    ) == (0.1, "gelu", False, 512, 30, True, 1.0, None)
    assert len(notes) == 1  # EOM trains differently there (batch priority ranks by the top-1 probability in both)
    back, _ = imported_options(json.loads(json.dumps(config)), "config.json")
    for name in (
        "encoder_layers",
        "decoder_layers",
        "encoder_ffn_embed_dim",
        "decoder_attention_heads",
        "moe_expert_count",
        "encoder_moe_freq",
        "moe_eom",
        "activation_fn",
        "dropout",
        "attention_dropout",
        "activation_dropout",
        "no_scale_embedding",
        "moe_batch_prioritized_routing",
    ):
        assert getattr(back, name) == getattr(options(), name), name
    assert back.decoder_moe_freq == 2 and back.max_target_positions == 512


@pytest.mark.parametrize("policy, after", [("sampling", False), ("random", True), ("all", True)])
def test_the_nllb_routing_options_become_nllb_moe_fields_and_come_back_as_the_same_flags(policy, after):
    ours = options(
        moe_second_expert_policy=policy,
        moe_normalize_gate=not after,
        moe_normalize_gate_after_dropping=after,
        moe_eval_capacity_token_fraction=0.25,
        moe_eval_capacity_factor=1.0,
        moe_batch_major_routing=True,
    )  # the fraction replaces the factor
    config, _ = hf_config(ours, "ck.pt", vocab=30, dtype="float32")
    assert (
        config["second_expert_policy"],
        config["normalize_router_prob_before_dropping"],
        config["moe_eval_capacity_token_fraction"],
    ) == (policy, not after, 0.25)
    back, notes = imported_options(json.loads(json.dumps(config)), "config.json")
    assert (
        back.moe_second_expert_policy,
        back.moe_normalize_gate_after_dropping,
        back.moe_normalize_gate,
        back.moe_eval_capacity_token_fraction,
        back.moe_batch_major_routing,
    ) == (policy, after, True, 0.25, True)
    assert (policy != "all") == any("drawn in evaluation too" in line for line in notes)


def test_hf_fractions_of_1_or_more_and_unset_ones_import_as_the_same_capacity():
    dropless, _ = imported_options(hf_config(options(), "ck.pt", vocab=30, dtype="float32")[0], "config.json")
    assert (dropless.moe_eval_capacity_token_fraction, dropless.moe_eval_capacity_factor) == (0.0, 0.0)
    config = dict(hf_config(options(), "ck.pt", vocab=30, dtype="float32")[0], moe_eval_capacity_token_fraction=0)
    branch_like, notes = imported_options(config, "config.json")  # expert_capacity None: 2*ceil(S/E), as the branch
    assert (branch_like.moe_eval_capacity_token_fraction, branch_like.moe_eval_capacity_factor) == (0.0, 1.0)
    assert any("keeps that count" in line for line in notes)


def test_the_shard_writer_keeps_each_shard_within_the_size_unless_one_tensor_is_larger(tmp_path):
    writer = ShardWriter(str(tmp_path), 100)
    sizes = {"a": 10, "b": 10, "c": 5, "big": 40, "d": 3}  # float32: 4 bytes each
    for name, count in sizes.items():
        writer.add(name, torch.full((count,), float(count)))
    files = writer.finish()
    index = json.loads((tmp_path / files[-1]).read_text())
    assert files[-1] == "model.safetensors.index.json" and index["metadata"]["total_size"] == 4 * sum(sizes.values())
    assert files[:-1] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for name in files[:-1]:
        read = SafetensorsFile(str(tmp_path / name))
        assert (tmp_path / name).stat().st_size - read.data_start <= 160  # the one tensor of 160 bytes alone
        assert all(
            index["weight_map"][t] == name and torch.equal(read.read(t), torch.full((sizes[t],), float(sizes[t])))
            for t in read.entries
        )
    assert sorted(index["weight_map"]) == sorted(sizes)


@pytest.mark.parametrize(
    "text, size", [("2GB", 2 * 10**9), ("500MB", 5 * 10**8), ("1GiB", 2**30), ("4096", 4096), ("0.5kb", 500)]
)
def test_max_shard_size_reads_sizes_as_transformers_writes_them(text, size):
    assert shard_size(text) == size


def test_a_max_shard_size_that_is_no_size_is_refused_in_one_line():
    with pytest.raises(CheckpointSetError, match="--max-shard-size '2 apples' is not a size"):
        shard_size("2 apples")
