"""``import-hf`` of the older Hugging Face weights format: ``pytorch_model-*.bin`` shards listed by
``pytorch_model.bin.index.json``, or one ``pytorch_model.bin`` (what ``save_pretrained(safe_serialization=
False)`` writes; the hub's NLLB-MoE copy: tests/interop/test_hf_hub_layout.py), read through the restricted
unpickler, each byte once for every output file together (a legacy-format .bin whole, one shard at a time), give
the set the safetensors files of the same model give."""

import datetime

import torch

from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from fairseq_moe_ext.checkpoint.hf.torch_bin_file import TorchBinFile, _Current
from support.inputs.fake_checkpoints import fingerprint
from support.oracles.hf_nllb_moe import NEEDS_TRANSFORMERS, hf_model
from support.oracles.read_counts import assert_each_byte_read_once, counted_reads

pytestmark = NEEDS_TRANSFORMERS


def imported(hf_dir, out):
    out.mkdir()
    assert checkpoint_tool(["import-hf", str(hf_dir), str(out / "ck.pt"), "--world-size", "2"]) == 0
    return [torch.load(out / f"ck-rank-{r}-of-2.pt", weights_only=False)["model"] for r in (0, 1)]


def test_bin_shards_and_a_single_bin_import_as_the_safetensors_files_of_the_model(tmp_path, monkeypatch):
    hf = hf_model()
    hf.save_pretrained(str(tmp_path / "st"), safe_serialization=True)
    hf.save_pretrained(str(tmp_path / "shards"), safe_serialization=False, max_shard_size="40KB")
    hf.save_pretrained(str(tmp_path / "single"), safe_serialization=False)
    assert len(list((tmp_path / "shards").glob("pytorch_model-*.bin"))) > 2
    assert (tmp_path / "shards" / "pytorch_model.bin.index.json").is_file()
    assert (tmp_path / "single" / "pytorch_model.bin").is_file()
    want = imported(tmp_path / "st", tmp_path / "from-st")
    reads = counted_reads(monkeypatch)
    for name in ("shards", "single"):
        got = imported(tmp_path / name, tmp_path / f"from-{name}")
        for mine, theirs in zip(got, want):
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs), name
        assert_each_byte_read_once(reads, tmp_path / name)  # for both output files together


def test_a_bin_in_torchs_legacy_format_imports_holding_one_shard_at_a_time(tmp_path, monkeypatch):
    """A .bin written by torch.save's own legacy (pre-1.6, non-zip) writer, as older hub repositories hold: it
    cannot be read in parts, so it is loaded whole, one shard held at a time."""
    hf = hf_model()
    hf.save_pretrained(str(tmp_path / "st"), safe_serialization=True)
    hf.save_pretrained(str(tmp_path / "legacy"), safe_serialization=False, max_shard_size="40KB")
    shards = sorted((tmp_path / "legacy").glob("pytorch_model-*.bin"))
    for shard in shards:
        torch.save(torch.load(shard, weights_only=True), shard, _use_new_zipfile_serialization=False)
        assert shard.read_bytes()[:1] == b"\x80"
    held, real = [], TorchBinFile._legacy_tensors

    def legacy_tensors(self, tensors):
        if tensors:
            held.append(_Current.loaded is not None)
        return real(self, tensors)

    monkeypatch.setattr(TorchBinFile, "_legacy_tensors", legacy_tensors)
    want = imported(tmp_path / "st", tmp_path / "from-st")
    got = imported(tmp_path / "legacy", tmp_path / "from-legacy")
    for mine, theirs in zip(got, want):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert held and not any(held), "a legacy .bin shard was loaded while another was still held"


def test_a_bin_shard_pickling_another_type_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    hf_model().save_pretrained(str(tmp_path / "hf"), safe_serialization=False)
    state = torch.load(tmp_path / "hf" / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "saved_at": datetime.datetime(2022, 7, 6)}, tmp_path / "hf" / "pytorch_model.bin")
    before = fingerprint(tmp_path / "hf")
    code = checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out.pt")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "pickles datetime.datetime" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out.pt").exists() and fingerprint(tmp_path / "hf") == before
