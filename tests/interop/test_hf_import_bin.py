"""``import-hf`` of the older Hugging Face weights format: ``pytorch_model-*.bin`` shards listed by
``pytorch_model.bin.index.json``, or one ``pytorch_model.bin`` (what ``save_pretrained(safe_serialization=
False)`` writes, and what the hub's NLLB-MoE copy may ship), read through the restricted unpickler one shard at
a time, give the set the safetensors files of the same model give."""

import datetime

import torch

from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from fairseq_moe_ext.checkpoint.hf.torch_bin_file import TorchBinFile, _Current
from support.inputs.fake_checkpoints import fingerprint
from support.oracles.hf_nllb_moe import NEEDS_TRANSFORMERS, hf_model

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
    shards = sorted(p.name for p in (tmp_path / "shards").glob("pytorch_model-*.bin"))
    assert len(shards) > 2 and (tmp_path / "shards" / "pytorch_model.bin.index.json").is_file()
    assert (tmp_path / "single" / "pytorch_model.bin").is_file()
    reads, held, real = [], [], TorchBinFile._tensors

    def tensors(self, tensors):
        if tensors:
            reads.append(self.path.rsplit("/", 1)[-1])
            held.append(_Current.loaded is not None)
        return real(self, tensors)

    monkeypatch.setattr(TorchBinFile, "_tensors", tensors)
    want = imported(tmp_path / "st", tmp_path / "from-st")
    for name in ("shards", "single"):
        got = imported(tmp_path / name, tmp_path / f"from-{name}")
        for mine, theirs in zip(got, want):
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs), name
    # one shard in memory at a time (the previous one let go before the next is read), each read once per output
    assert not any(held), "a .bin shard was read while another was still held"
    assert all(reads.count(shard) <= 2 for shard in shards) and set(shards) <= set(reads)


def test_a_bin_shard_pickling_another_type_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    hf_model().save_pretrained(str(tmp_path / "hf"), safe_serialization=False)
    state = torch.load(tmp_path / "hf" / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "saved_at": datetime.datetime(2022, 7, 6)}, tmp_path / "hf" / "pytorch_model.bin")
    before = fingerprint(tmp_path / "hf")
    code = checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out.pt")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "pickles datetime.datetime" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out.pt").exists() and fingerprint(tmp_path / "hf") == before
