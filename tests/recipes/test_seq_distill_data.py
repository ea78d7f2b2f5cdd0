"""recipes/seq_distill_data.py's shards: a shard's teacher output is kept across runs (a restart generates only
what is missing), but only while the shards are cut the same way."""

import sys

from support.launch.paths import REPO_ROOT as ROOT

sys.path.insert(0, str(ROOT / "recipes"))
from seq_distill_data import cut  # noqa: E402


def write_corpus(tok, lines):
    tok.mkdir(parents=True, exist_ok=True)
    for side in ("src", "tgt"):
        (tok / f"train.{side}").write_text("".join(f"{side} {i}\n" for i in range(lines)))


def test_a_shards_teacher_output_survives_a_rerun_but_not_a_new_cut(tmp_path):
    tok, shards = tmp_path / "tok", tmp_path / "shards"
    write_corpus(tok, 5)
    assert cut(tok, 2, shards) == 3
    assert (shards / "00002.src").read_text() == "src 4\n"
    (shards / "00000.hyp").write_text("hyp 0\nhyp 1\n")  # the teacher's output of the first shard
    assert cut(tok, 2, shards) == 3 and (shards / "00000.hyp").read_text() == "hyp 0\nhyp 1\n"
    # cut in 3s, shard 0 holds sentences 0..2: the output of sentences 0..1 must not stand for it
    assert cut(tok, 3, shards) == 2 and not (shards / "00000.hyp").exists()
    assert (shards / "00000.src").read_text() == "src 0\nsrc 1\nsrc 2\n"
    write_corpus(tok, 7)  # another corpus, the same cut: cut again, outputs gone
    (shards / "00001.hyp").write_text("hyp\n")
    assert cut(tok, 3, shards) == 3 and not list(shards.glob("*.hyp"))
