"""``export-hf`` and ``import-hf`` against the oracle nobody here wrote: transformers' own
``NllbMoeForConditionalGeneration`` (test-only, 4.57.1, whose experts module loops over every expert as
the nllb branch does). A set this plugin wrote loads in HF with the same encoder outputs and logits;
HF checkpoints (ours exported, and ones transformers' ``save_pretrained`` wrote) come back as sets with
the same tensors and logits. fp32, evaluation, no padding, nothing dropped (dropless <-> fraction 1.0)."""

import json

import pytest
import torch

from fairseq import checkpoint_utils
from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.inputs.hf_sets import EXPERTS, HF_FLAGS, batch, build, joined_data, write_set
from support.oracles.hf_nllb_moe import NEEDS_TRANSFORMERS

safetensors_torch = pytest.importorskip("safetensors.torch")
# slow: each case builds Hugging Face NllbMoe and fairseq models end to end, about 10 s of CPU for its
# 11 cases (7 Dec 2026): too much for the fast tier (--fast) run after every edit.
pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return joined_data(tmp_path_factory.mktemp("joined"))


@pytest.fixture(scope="module")
def ours(data):
    """(args, task, model): a tiny moe_transformer NllbMoe can express, with Expert Output Masking."""
    return build(data, *HF_FLAGS)


def our_outputs(model, tokens):
    src, lengths, prev = tokens
    with torch.no_grad():
        encoder = model.encoder(src, lengths)["encoder_out"][0].transpose(0, 1)
        return encoder, model(src, lengths, prev)[0]


def hf_outputs(hf_dir, tokens):
    from transformers import NllbMoeForConditionalGeneration

    model = NllbMoeForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    src, _, prev = tokens
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=prev)
    return out.encoder_last_hidden_state, out.logits


def loaded(path, task):
    models, _ = checkpoint_utils.load_model_ensemble([str(path)], task=task)
    return models[0].eval()


def export(name, out, *flags):
    assert checkpoint_tool(["export-hf", str(name), str(out), *flags]) == 0
    return out


def test_the_oracle_itself_changes_its_logits_when_an_expert_tokens_reach_is_zeroed(ours, tmp_path):
    args, _, model = ours
    hf_dir = export(write_set(args, model, tmp_path / "set" / "ck.pt"), tmp_path / "hf")
    from transformers import NllbMoeForConditionalGeneration

    hf = NllbMoeForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    src, _, prev = batch()
    routed = []
    sparse = hf.model.encoder.layers[1].ffn
    sparse.router.register_forward_hook(lambda module, inputs, output: routed.append(output[1]))
    with torch.no_grad():
        before = hf(input_ids=src, decoder_input_ids=prev).logits
        reached = routed[0].gt(0).any(0)
        for expert in range(EXPERTS):  # every expert some token reaches matters, experts 2 and 3 included
            if reached[expert]:
                fc2 = sparse.experts[f"expert_{expert}"].fc2
                saved = fc2.weight.clone()
                fc2.weight.zero_()
                assert not torch.allclose(hf(input_ids=src, decoder_input_ids=prev).logits, before), expert
                fc2.weight.copy_(saved)
    assert reached.sum() >= 3


@pytest.mark.parametrize("world", [1, 2], ids=["one-file", "two-rank-files"])
def test_an_exported_set_gives_hf_nllb_moe_the_same_encoder_outputs_and_logits(ours, tmp_path, capsys, world):
    args, _, model = ours
    name = write_set(args, model, tmp_path / "set" / "ck.pt", world)
    hf_dir = export(name, tmp_path / "hf", "--max-shard-size", "40KB")
    printed = capsys.readouterr().out
    assert "NOTE --moe-eom 0.2 -> moe_token_dropout 0.2" in printed
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    config = json.loads((hf_dir / "config.json").read_text())
    assert (
        config["num_experts"],
        config["moe_token_dropout"],
        config["moe_eval_capacity_token_fraction"],
        config["encoder_sparse_step"],
        config["second_expert_policy"],
    ) == (EXPERTS, 0.2, 1.0, 2, "all")
    tokens = batch()
    for theirs, mine in zip(hf_outputs(hf_dir, tokens), our_outputs(model, tokens)):
        assert (theirs - mine).abs().max() < TOLERANCE


def test_a_set_trained_dropless_exports_with_training_as_nllb_a_note_and_the_same_logits(data, tmp_path, capsys):
    # HF_FLAGS but for the training capacity: the default, dropless training
    at = HF_FLAGS.index("--moe-capacity-factor")
    args, _, model = build(data, *HF_FLAGS[:at], *HF_FLAGS[at + 2 :], "--moe-gate-noise", "0.5")
    name = write_set(args, model, tmp_path / "set" / "ck.pt", 2)
    assert checkpoint_tool(["export-hf", str(name), str(tmp_path / "refused")]) == 2
    hf_dir = export(name, tmp_path / "hf", "--training-as-nllb")
    printed = capsys.readouterr().out
    assert "NOTE --moe-capacity-factor 0.0: NllbMoe trains with 2*ceil(S/E)" in printed
    assert "NOTE --moe-gate-noise 0.5" in printed and not (tmp_path / "refused").exists()
    assert json.loads((hf_dir / "config.json").read_text())["expert_capacity"] is None
    tokens = batch(seed=7)
    for theirs, mine in zip(hf_outputs(hf_dir, tokens), our_outputs(model, tokens)):
        assert (theirs - mine).abs().max() < TOLERANCE


@pytest.mark.parametrize(
    "source_world, world", [(1, 1), (2, 2), (2, 1), (1, 4)], ids=["1-to-1", "2-to-2", "2-to-1", "1-to-4"]
)
def test_import_hf_of_an_exported_set_gives_back_every_tensor_of_the_original(ours, tmp_path, source_world, world):
    args, task, model = ours
    hf_dir = export(
        write_set(args, model, tmp_path / "set" / "ck.pt", source_world), tmp_path / "hf", "--max-shard-size", "64KB"
    )
    (tmp_path / "back").mkdir()
    assert (
        checkpoint_tool(["import-hf", str(hf_dir), str(tmp_path / "back" / "ck.pt"), "--world-size", str(world)]) == 0
    )
    files = sorted(p.name for p in (tmp_path / "back").iterdir())
    assert files == (
        ["ck.pt"] if world == 1 else [f"ck-rank-{r}-of-{world}.pt" for r in range(world)] + ["ck.set.json"]
    )
    back, original = moe_ckpt.load_full(str(tmp_path / "back" / "ck.pt"))["model"], model.state_dict()
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    tokens = batch(seed=3)
    back_model = loaded(tmp_path / "back" / "ck.pt", task)
    assert back_model.args.moe_batch_major_routing  # HF's queue order: the same slots, rows summed in another order
    torch.testing.assert_close(our_outputs(back_model, tokens)[1], our_outputs(model, tokens)[1], atol=1e-6, rtol=0)


def hf_model(seed=0, **changes):
    """A random NllbMoe of the tiny set's shape, as transformers itself initialises it."""
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    config = dict(
        vocab_size=24,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        num_experts=EXPERTS,
        encoder_sparse_step=2,
        decoder_sparse_step=2,
        max_position_embeddings=1024,
        expert_capacity=None,
        normalize_router_prob_before_dropping=True,
        moe_eval_capacity_token_fraction=1.0,
        moe_token_dropout=0.2,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_start_token_id=2,
        init_std=0.2,
    )
    torch.manual_seed(seed)
    model = NllbMoeForConditionalGeneration(NllbMoeConfig(**{**config, **changes}))
    with torch.no_grad():  # layer norms and biases start at 1 and 0 there: move them too
        for name, p in model.named_parameters():
            if "layer_norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("world", [1, 2])
def test_an_hf_checkpoint_saved_by_transformers_imports_with_the_same_logits(ours, tmp_path, capsys, world):
    _, task, _ = ours
    hf = hf_model()
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True, max_shard_size="60KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    (tmp_path / "ours").mkdir()
    assert (
        checkpoint_tool(
            ["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours" / "ck.pt"), "--world-size", str(world)]
        )
        == 0
    )
    assert "moe_token_dropout 0.2 -> --moe-eom 0.2" in capsys.readouterr().out
    tokens = batch(seed=5)
    src, _, prev = tokens
    with torch.no_grad():
        theirs = hf(input_ids=src, decoder_input_ids=prev)
    mine = our_outputs(loaded(tmp_path / "ours" / "ck.pt", task), tokens)
    assert (theirs.encoder_last_hidden_state - mine[0]).abs().max() < TOLERANCE
    assert (theirs.logits - mine[1]).abs().max() < TOLERANCE


def test_export_streams_one_rank_file_at_a_time_and_holds_at_most_one_shard_of_tensors(ours, tmp_path, monkeypatch):
    from fairseq_moe_ext.checkpoint.hf import exporter as hf_export

    args, _, model = ours
    name = write_set(args, model, tmp_path / "set" / "ck.pt", 4)
    events, real_load, real_write = [], hf_export.safe_load, hf_export.write_safetensors
    limit = 10_000  # above any one tensor (an expert's fc1 is 6 kB), below one rank file's experts (25 kB)

    def load(path, **kw):
        events.append(("load", path.split("-")[-3]))
        return real_load(path, **kw)

    def write(path, tensors, metadata=None):
        held = sum(t.numel() * t.element_size() for _, t in tensors)
        assert held <= limit
        events.append(("write", held))
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(hf_export, "safe_load", load)
    monkeypatch.setattr(hf_export, "write_safetensors", write)
    hf_export.export_hf(str(name), str(tmp_path / "hf"), limit, report=lambda line: None)
    loads = [i for i, e in enumerate(events) if e[0] == "load"]
    assert [events[i][1] for i in loads] == ["0", "1", "2", "3"]
    assert all(events[i + 1][0] == "write" for i in loads[1:-1])  # a shard is written between two rank files
