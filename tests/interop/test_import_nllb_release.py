"""``import-fairseq-moe`` on a lookalike of the NLLB-200 MoE release (``recipes/nllb_tiny_set.py``: E experts
over 2E rank files with replicas, fp16, fp16 Adam moments in every file, NLLB's options, ``langs.txt`` as one
comma line), and on its first E rank files alone; each file read once and its optimizer state never."""

import argparse
import io
import os
import sys
import zipfile

import pytest
import torch

from fairseq_moe_ext.checkpoint import one_read
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from fairseq_moe_ext.checkpoint.branch import importer as branch_import
from fairseq_moe_ext.checkpoint.branch.vocab import read_languages
from fairseq_moe_ext.checkpoint.progress import Progress
from support.inputs.fake_checkpoints import fingerprint
from support.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "recipes"))
from nllb_tiny_set import EXPERTS, LANGS, PREFIX, RANKS, write_release_set  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
REPLICA_NOTE = f"NOTE {EXPERTS} of the run's {RANKS} rank files are here"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    return {
        "replicas": write_release_set(str(root / "replicas")),
        "first-half": write_release_set(str(root / "first-half"), first_experts_only=True),
    }


def run_import(prefix, output, *extra):
    return checkpoint_tool(["import-fairseq-moe", str(prefix), str(output), *extra])


def optimizer_data_offsets(path):
    """The file offsets of the tensor data that ``last_optimizer_state`` pickles (torch's meta load)."""
    state = torch.load(path, map_location="meta", weights_only=False)
    offsets, stack = set(), [state["last_optimizer_state"]]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            offsets.add((value.untyped_storage()._checkpoint_offset, value.untyped_storage().nbytes()))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return offsets


@pytest.mark.parametrize("variant", ["replicas", "first-half"])
def test_the_release_imports_from_all_rank_files_or_the_first_e_alone_to_the_same_set(
    release, tmp_path, capsys, variant
):
    out = tmp_path / "out"
    out.mkdir()
    prefix = release[variant]
    downloads = os.path.dirname(os.path.dirname(prefix))  # the checkpoints unpack into model_moe_54b/ there
    dictionary, langs = f"{downloads}/dictionary.txt", f"{downloads}/langs.txt"
    assert open(langs).read().count("\n") == 1 and "," in open(langs).read()  # NLLB's: one comma line
    code = run_import(prefix, out / "imported.pt", "--world-size", "2", "--dictionary", dictionary, "--langs", langs)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "+ 3 language tokens + 3 data-source tags = 70 rows" in printed.out
    notes = [line for line in printed.out.splitlines() if line.startswith(REPLICA_NOTE)]
    assert len(notes) == (1 if variant == "first-half" else 0), printed.out
    if variant == "first-half":
        assert f"ranks {EXPERTS}..{RANKS - 1} hold replicas only" in notes[0]
    ours = [torch.load(out / f"imported-rank-{r}-of-2.pt", weights_only=False)["model"] for r in (0, 1)]
    assert all(t.dtype == torch.float16 for m in ours for t in m.values() if t.is_floating_point())
    # the shared file's three copies of the tied embedding are written once
    tied = [
        ours[0][f"{k}.weight"] for k in ("encoder.embed_tokens", "decoder.embed_tokens", "decoder.output_projection")
    ]
    assert len({t.untyped_storage().data_ptr() for t in tied}) == 1
    # the experts are the source's: rank file r (r < E) holds expert r under local number 0
    source = torch.load(f"{prefix}-rank-3.pt", weights_only=False)["model"]
    key = next(k for k in source if k.endswith("fc1.weight"))
    stacked = ours[1][key.replace(".moe_layer.experts.0.fc1.weight", ".fc1.experts.batched_fc1_w")]
    assert torch.equal(stacked[1], source[key])


def test_the_releases_namespace_task_gives_the_languages_and_the_gate_loss_sum_is_kept(release, tmp_path, capsys):
    from fairseq import checkpoint_utils

    prefix = release["first-half"]
    head = torch.load(f"{prefix}-shared.pt", weights_only=False)["cfg"]
    assert isinstance(head["task"], argparse.Namespace) and head["criterion"]["moe_gate_loss_combine_method"] == "sum"
    dictionary = os.path.join(os.path.dirname(os.path.dirname(prefix)), "dictionary.txt")
    assert run_import(prefix, tmp_path / "imported.pt", "--dictionary", dictionary) == 0  # no --langs: the task's
    assert "+ 3 language tokens + 3 data-source tags = 70 rows" in capsys.readouterr().out
    cfg = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "imported.pt"))["cfg"]  # fairseq's own load
    assert cfg.criterion.moe_gate_loss_combine_method == "sum" and cfg.task.langs == list(LANGS)


def test_a_replica_that_differs_from_its_expert_is_refused_in_one_line(release, tmp_path, capsys):
    source = tmp_path / "set"
    source.mkdir()  # a copy of the replicated set, with rank 6's copy of expert 2 changed
    model_dir = release["replicas"].rsplit("/", 1)[0]
    for r in range(RANKS):
        (source / f"{PREFIX}-rank-{r}.pt").write_bytes(open(f"{model_dir}/{PREFIX}-rank-{r}.pt", "rb").read())
    (source / f"{PREFIX}-shared.pt").write_bytes(open(f"{model_dir}/{PREFIX}-shared.pt", "rb").read())
    state = torch.load(source / f"{PREFIX}-rank-6.pt", weights_only=False)
    key = next(k for k in state["model"] if k.endswith("fc2.bias"))
    state["model"][key] = state["model"][key] + 1
    torch.save(state, source / f"{PREFIX}-rank-6.pt")
    before = fingerprint(source)
    assert run_import(source / PREFIX, tmp_path / "imported.pt") == 2
    err = capsys.readouterr().err.strip()
    assert "hold different copies of expert 2" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "imported.pt").exists() and fingerprint(source) == before


def test_each_input_byte_is_read_at_most_once_and_the_optimizer_state_never(release, tmp_path, monkeypatch):
    readers = []
    real = one_read.CountingReader

    def counting(path, on_read=None):
        reader = real(path, on_read)
        readers.append((path, reader))
        return reader

    monkeypatch.setattr(one_read, "CountingReader", counting)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load read a whole input file"))
    prefix = release["replicas"]
    branch_import.import_branch_set(prefix, str(tmp_path / "imported.pt"), 1, report=lambda line: None)
    monkeypatch.undo()
    by_path = {}
    for path, reader in readers:
        by_path.setdefault(path, []).extend(reader.reads)
    assert sorted(by_path) == sorted([f"{prefix}-shared.pt"] + [f"{prefix}-rank-{r}.pt" for r in range(RANKS)])
    for path, reads in by_path.items():
        size = len(open(path, "rb").read())
        spans = sorted(reads)
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"{path}: a byte was read twice"
        skipped = optimizer_data_offsets(path)
        assert skipped, path  # the lookalike carries optimizer state in every file, as the release
        for offset, nbytes in skipped:
            assert all(s + n <= offset or offset + nbytes <= s for s, n in spans), f"{path}: optimizer state read"
        assert sum(n for _, n in spans) <= size - sum(n for _, n in skipped)


def test_a_file_read_once_gives_the_tensors_torch_load_gives_and_a_damaged_member_is_refused(release, tmp_path):
    path = f"{release['replicas']}-rank-1.pt"
    mine = one_read.load_skipping(path)
    theirs = torch.load(path, weights_only=False)
    assert "last_optimizer_state" not in mine and set(mine) == set(theirs) - {"last_optimizer_state"}
    assert mine["model"].keys() == theirs["model"].keys()
    assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])
    data = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as archive:
        member = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    data[member.header_offset + 30 + len(member.filename) + 200] ^= 0xFF  # inside the first tensor's bytes
    (tmp_path / "damaged.pt").write_bytes(bytes(data))
    with pytest.raises(Exception, match="damaged.pt is damaged or incomplete .*Bad CRC-32"):
        one_read.load_skipping(str(tmp_path / "damaged.pt"))


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_bar_shows_bytes_rate_and_eta_on_a_terminal_and_nothing_in_a_log(release, tmp_path, capsys):
    terminal, log = Terminal(), io.StringIO()
    for stream, name in ((terminal, "a"), (log, "b")):
        branch_import.import_branch_set(
            release["first-half"], str(tmp_path / f"{name}.pt"), 1, report=lambda line: None, progress_stream=stream
        )
    assert log.getvalue() == "" and capsys.readouterr().err == ""
    last = terminal.getvalue().rstrip("\n").split("\r")[-1]
    assert "reading checkpoint_2_300000: " in last and "(100%)" in last and "/s, ETA 0:00" in last, last
    now = [0.0]
    bar = Progress("x", stream=Terminal(), clock=lambda: now[0])
    bar.set_total(4_000_000_000)
    now[0] = 10.0
    bar.read(1_000_000_000)  # a quarter in 10 s: 100 MB/s, 30 s left
    assert bar.line() == "x: 1.0 GB of 4.0 GB (25%), 100.0 MB/s, ETA 0:30"


@pytest.mark.parametrize(
    "text, codes",
    [
        ("eng_Latn,fra_Latn,deu_Latn\n", ["eng_Latn", "fra_Latn", "deu_Latn"]),  # NLLB's langs.txt
        ("eng_Latn\nfra_Latn\ndeu_Latn\n", ["eng_Latn", "fra_Latn", "deu_Latn"]),  # stock --lang-dict's
        ("eng_Latn, fra_Latn,\ndeu_Latn", ["eng_Latn", "fra_Latn", "deu_Latn"]),
    ],
    ids=["one-comma-line", "one-per-line", "both"],
)
def test_language_lists_are_read_with_commas_and_or_newlines_in_their_order(tmp_path, text, codes):
    (tmp_path / "langs.txt").write_text(text)
    assert read_languages(str(tmp_path / "langs.txt")) == codes
    assert read_languages(",".join(codes)) == codes
