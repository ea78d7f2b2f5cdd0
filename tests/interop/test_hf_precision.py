"""fp16 / bf16 through ``export-hf`` and ``import-hf`` (``checkpoint/hf/dtype.py``), against transformers'
own NllbMoe (4.57.1, test-only). A set keeps its dtype on the way out (config.json's ``torch_dtype`` says
which) and a Hugging Face checkpoint keeps its dtype on the way in; ``--dtype`` casts while streaming.
Logits are compared in fp32 on both sides, from the same (rounded) weights: HF loads with
``torch_dtype=torch.float32``, fairseq casts into its fp32 parameters when it loads."""

import copy
import json

import pytest
import torch

from fairseq import checkpoint_utils
from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from fairseq_moe_ext.checkpoint.hf.keys import EMBEDDING, NOT_WEIGHTS, TIED_HERE, expert_tensor, hf_expert_key, hf_key
from support.inputs.hf_sets import HF_FLAGS, batch, build, joined_data, write_set
from support.oracles import hf_nllb_moe
from support.oracles.hf_nllb_moe import NEEDS_TRANSFORMERS

safetensors_torch = pytest.importorskip("safetensors.torch")
# slow: each case exports and imports a set through Hugging Face NllbMoe, about 5 s of CPU for its 11
# cases (7 Dec 2026): too much for the fast tier (--fast) run after every edit.
pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]
TOLERANCE = 1e-5
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """(args, task, fp32 model): the tiny moe_transformer NllbMoe can express (tests/support/inputs/hf_sets.py)."""
    return build(joined_data(tmp_path_factory.mktemp("joined")), *HF_FLAGS)


def in_dtype(model, dtype):
    return copy.deepcopy(model).to(dtype)


def fp32_from(model, stored):
    """``model`` (fp32) with ``stored``'s weights, as fairseq loads a checkpoint: cast into fp32 parameters.
    (Not ``stored.float()``: the sinusoidal position table is a non-persistent buffer ``.half()`` rounds.)"""
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(stored.state_dict())
    return fresh


def hf_files(hf_dir):
    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(str(path)))
    return tensors


def expected_hf_tensors(state):
    """What export-hf must write for our ``state``, by the plugin's own names (hf/keys.py)."""
    out = {}
    for key, tensor in state.items():
        found = expert_tensor(key)
        if found is not None:
            out.update({hf_expert_key(*found, j): tensor[j] for j in range(tensor.shape[0])})
        elif not NOT_WEIGHTS.match(key) and key not in TIED_HERE:
            out[hf_key(key)] = tensor
    return out


def assert_bitwise(files, expected, dtype):
    assert sorted(files) == sorted(expected)
    for name, tensor in expected.items():
        assert files[name].dtype == dtype and torch.equal(files[name].view(torch.uint8), tensor.view(torch.uint8)), name


def hf_logits(hf_dir, src, prev):
    from transformers import NllbMoeForConditionalGeneration

    hf = NllbMoeForConditionalGeneration.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    assert hf.dtype == torch.float32
    with torch.no_grad():
        return hf(input_ids=src, decoder_input_ids=prev).logits


def our_logits(model, src, prev):
    with torch.no_grad():
        return model(src, torch.full((src.shape[0],), src.shape[1]), prev)[0]


def loaded(path, task):
    models, _ = checkpoint_utils.load_model_ensemble([str(path)], task=task)
    return models[0].eval()


def weights(state):
    return {k: v for k, v in state.items() if not NOT_WEIGHTS.match(k)}


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_an_fp16_or_bf16_set_exports_bitwise_says_its_dtype_and_round_trips_in_fp32(ours, tmp_path, capsys, low):
    args, task, model = ours
    half = in_dtype(model, DTYPES[low])
    hf_dir = tmp_path / "hf"
    assert checkpoint_tool(["export-hf", str(write_set(args, half, tmp_path / "set" / "ck.pt", 2)), str(hf_dir)]) == 0
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == low
    assert_bitwise(hf_files(hf_dir), expected_hf_tensors(half.state_dict()), DTYPES[low])
    src, _, prev = batch(seed=2)
    theirs, fp32 = hf_logits(hf_dir, src, prev), our_logits(fp32_from(model, half), src, prev)
    assert (theirs - fp32).abs().max() < TOLERANCE
    assert (theirs - our_logits(model, src, prev)).abs().max() > 100 * TOLERANCE  # the rounding is seen
    # back in: the same dtype, bitwise, and fairseq's fp32 model computes HF's logits
    (tmp_path / "back").mkdir()
    assert checkpoint_tool(["import-hf", str(hf_dir), str(tmp_path / "back" / "ck.pt"), "--world-size", "2"]) == 0
    assert f"tensors {low}, as the Hugging Face files hold them" in capsys.readouterr().out
    back, original = weights(moe_ckpt.load_full(str(tmp_path / "back" / "ck.pt"))["model"]), weights(half.state_dict())
    assert sorted(back) == sorted(original)
    assert all(back[k].dtype == DTYPES[low] and torch.equal(back[k], original[k]) for k in original)
    assert (our_logits(loaded(tmp_path / "back" / "ck.pt", task), src, prev) - theirs).abs().max() < TOLERANCE


@pytest.mark.parametrize("source, cast", [("float32", "bfloat16"), ("float16", "float32")], ids=["down", "up"])
def test_export_hf_dtype_casts_every_tensor_while_streaming_and_config_names_the_cast(
    ours, tmp_path, capsys, source, cast
):
    args, _, model = ours
    stored = in_dtype(model, DTYPES[source])
    name = write_set(args, stored, tmp_path / "set" / "ck.pt", 2)
    hf_dir = tmp_path / "hf"
    assert checkpoint_tool(["export-hf", str(name), str(hf_dir), "--dtype", cast, "--max-shard-size", "30KB"]) == 0
    assert f"{source} weights cast to {cast} (--dtype)" in capsys.readouterr().out
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == cast
    expected = {k: v.to(DTYPES[cast]) for k, v in expected_hf_tensors(stored.state_dict()).items()}
    assert_bitwise(hf_files(hf_dir), expected, DTYPES[cast])
    src, _, prev = batch(seed=4)
    same_weights = fp32_from(model, in_dtype(stored, DTYPES[cast]))
    assert (hf_logits(hf_dir, src, prev) - our_logits(same_weights, src, prev)).abs().max() < TOLERANCE


def test_a_cast_export_still_holds_one_rank_file_and_one_shard_of_cast_tensors(ours, tmp_path, monkeypatch):
    from fairseq_moe_ext.checkpoint.hf import exporter as hf_export

    args, _, model = ours
    name = write_set(args, model, tmp_path / "set" / "ck.pt", 4)
    events, real_load, real_write = [], hf_export.safe_load, hf_export.write_safetensors
    limit = 5_000  # fp16: above any one tensor (an expert's fc1 is 3 kB), below one rank file's experts

    def write(path, tensors, metadata=None):
        assert all(t.dtype == torch.float16 for _, t in tensors)
        held = sum(t.numel() * t.element_size() for _, t in tensors)
        assert held <= limit
        events.append("write")
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(hf_export, "safe_load", lambda path, **kw: events.append("load") or real_load(path, **kw))
    monkeypatch.setattr(hf_export, "write_safetensors", write)
    hf_export.export_hf(str(name), str(tmp_path / "hf"), limit, report=lambda line: None, dtype=torch.float16)
    loads = [i for i, e in enumerate(events) if e == "load"]
    assert len(loads) == 4 and all(events[i + 1] == "write" for i in loads[1:-1])


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_an_fp16_or_bf16_hf_checkpoint_imports_in_its_dtype_with_hfs_fp32_logits(tmp_path, capsys, low):
    hf = hf_nllb_moe.hf_model().to(DTYPES[low])
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True, max_shard_size="20KB")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == low  # transformers' own key
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    task = hf_nllb_moe.oracle_task(tmp_path / "data")
    (tmp_path / "kept").mkdir(), (tmp_path / "fp32").mkdir()
    kept, fp32 = tmp_path / "kept" / "ck.pt", tmp_path / "fp32" / "ck.pt"
    assert checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(kept), "--world-size", "2"]) == 0
    assert checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(fp32), "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert f"tensors {low}, as the Hugging Face files hold them" in printed
    assert f"tensors cast from {low} to float32 (--dtype)" in printed
    as_kept, as_fp32 = (weights(moe_ckpt.load_full(str(p))["model"]) for p in (kept, fp32))
    assert {t.dtype for t in as_kept.values()} == {DTYPES[low]} and {t.dtype for t in as_fp32.values()} == {
        torch.float32
    }
    assert all(torch.equal(as_kept[k].float(), as_fp32[k]) for k in as_kept)
    src, prev = hf_nllb_moe.batch([6, 6, 6], seed=1)  # no padding
    theirs = hf_logits(tmp_path / "hf", src, prev)
    # the float32 import holds the same values (checked above), so fairseq computes the same from either
    assert (our_logits(loaded(kept, task), src, prev) - theirs).abs().max() < TOLERANCE
    assert as_kept[EMBEDDING].shape[0] == hf_nllb_moe.VOCAB


# ---------------------------------------------------------------- bad input: one line, nothing written


def _mixed(model):
    mixed = copy.deepcopy(model)
    layer = mixed.decoder.layers[1].fc1.experts
    layer.batched_fc1_w.data = layer.batched_fc1_w.data.half()
    return mixed


def _quantized(hf_dir):
    path = next(hf_dir.glob("*.safetensors"))
    tensors = safetensors_torch.load_file(str(path))
    name = next(n for n in sorted(tensors) if n.endswith("fc1.weight"))
    tensors[name] = tensors[name].mul(100).to(torch.int8)
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})


# fmt: off
BAD_DTYPES = [
    # (id, command, the set's model from ours (export) or damage to an exported directory (import), extra flags,
    #  the one line says)
    ("export-unknown-dtype", "export-hf", None, ["--dtype", "float8"],
     "export-hf --dtype 'float8' is not a dtype written here: give float32, float16 or bfloat16"),
    ("import-unknown-dtype", "import-hf", None, ["--dtype", "int8"],
     "import-hf --dtype 'int8' is not a dtype written here: give float32, float16 or bfloat16"),
    ("export-float64-set", "export-hf", lambda m: in_dtype(m, torch.float64), [],
     "holds float64 weights (encoder.embed_tokens.weight): export-hf writes float32, float16 or bfloat16"),
    ("export-mixed-dtypes", "export-hf", _mixed, [],
     "holds float16 and float32 weights (decoder.layers.1.fc1.experts.batched_fc1_w is float16, "
     "encoder.embed_tokens.weight float32), but config.json's torch_dtype names one dtype: export with --dtype"),
    ("import-quantized-weights", "import-hf", _quantized, [], "as int8: a quantized checkpoint"),
]
# fmt: on


@pytest.mark.parametrize(
    "command, change, extra, message", [row[1:] for row in BAD_DTYPES], ids=[row[0] for row in BAD_DTYPES]
)
def test_a_dtype_the_exchange_cannot_write_is_refused_in_one_line_and_nothing_is_written(
    ours, tmp_path, capsys, command, change, extra, message
):
    from support.inputs.fake_checkpoints import fingerprint

    args, _, model = ours
    stored = change(model) if command == "export-hf" and change else model
    source = write_set(args, stored, tmp_path / "set" / "ck.pt", 2)
    if command == "import-hf":
        assert checkpoint_tool(["export-hf", str(source), str(tmp_path / "hf")]) == 0
        source = tmp_path / "hf"
        if change:
            change(source)
        out = tmp_path / "out" / "ck.pt"
        out.parent.mkdir()
    else:
        out = tmp_path / "out"
    capsys.readouterr()
    inputs = source if source.is_dir() else source.parent
    before = fingerprint(inputs)
    code = checkpoint_tool([command, str(source), str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert fingerprint(tmp_path / "out") in (None, {}) and fingerprint(inputs) == before


def test_a_rank_file_in_another_dtype_than_rank_0_is_refused_as_it_is_streamed(ours, tmp_path, capsys):
    from fairseq_moe_ext.checkpoint.manifest import describe_file

    args, _, model = ours
    write_set(args, model, tmp_path / "set" / "ck.pt", 2)
    rank1, manifest = tmp_path / "set" / "ck-rank-1-of-2.pt", tmp_path / "set" / "ck.set.json"
    state = torch.load(rank1, weights_only=False)
    state["model"] = {k: v.half() if ".fc1.experts." in k else v for k, v in state["model"].items()}
    torch.save(state, rank1)
    listed = json.loads(manifest.read_text())  # a hand-edited set, consistent with its manifest
    listed["files"] = [describe_file(str(rank1)) | {"rank": 1} if f["rank"] == 1 else f for f in listed["files"]]
    manifest.write_text(json.dumps(listed))
    capsys.readouterr()
    assert checkpoint_tool(["export-hf", str(tmp_path / "set" / "ck.pt"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "ck-rank-1-of-2.pt: encoder.layers.1.fc1.experts.batched_fc1_w is float16, rank 0's weights float32" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "hf").exists()
