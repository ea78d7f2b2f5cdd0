"""recipes/nllb_files.py: where recipes/nllb_moe.sh finds the NLLB-200 MoE downloads as a user unpacks them (the
model tarball into ``model_moe_54b/``; the dictionary, NLLB's SentencePiece model and the language list beside
it), and the one line naming the download of whichever is missing."""

import shlex
import sys

import pytest

from support.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "recipes"))
from nllb_files import main  # noqa: E402

PREFIX = "checkpoint_2_300000"
SPM = "flores200_sacrebleu_tokenizer_spm.model"


def downloads(root, missing=()):
    """The four downloads unpacked into ``root``, less ``missing``."""
    (root / "model_moe_54b").mkdir(parents=True)
    for name in (f"model_moe_54b/{PREFIX}-shared.pt", f"model_moe_54b/{PREFIX}-rank-0.pt", "dictionary.txt", SPM):
        if name not in missing:
            (root / name).write_text("x")
    if "langs.txt" not in missing:
        (root / "langs.txt").write_text("eng_Latn,fra_Latn\n")
    return root


def found(capsys, *argv):
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    return dict(word.split("=", 1) for word in shlex.split(capsys.readouterr().out))


@pytest.mark.parametrize("given", ["parent", "model_moe_54b"])
def test_model_dir_may_be_the_tarballs_directory_or_its_parent_and_nllbs_spm_name_is_found(tmp_path, capsys, given):
    root = downloads(tmp_path / "nllb")
    model_dir = root if given == "parent" else root / "model_moe_54b"
    files = found(capsys, model_dir, PREFIX, "", "", "", "--need-spm")
    assert files["CKPT_DIR"] == str(root / "model_moe_54b")
    assert files == {**files, "DICT": str(root / "dictionary.txt"), "SPM": str(root / SPM)}
    assert files["LANGS"] == str(root / "langs.txt")


# fmt: off
MISSING = [
    (f"model_moe_54b/{PREFIX}-shared.pt", f"{PREFIX}-shared.pt is missing: download https://tinyurl.com/nllb200moe54bmodel"),
    (f"model_moe_54b/{PREFIX}-rank-0.pt", f"{PREFIX}-rank-0.pt is missing: download https://tinyurl.com/nllb200moe54bmodel"),
    ("dictionary.txt", "dictionary.txt is not in"),
    (SPM, f"{SPM} is not in"),
    ("langs.txt", "langs.txt is not in"),
]
URLS = {"dictionary.txt": "https://tinyurl.com/nllb200dictionary", SPM: "https://tinyurl.com/flores200sacrebleuspm",
        "langs.txt": "fairseq/nllb/examples/nllb/modeling/scripts/flores200/langs.txt"}
# fmt: on


@pytest.mark.parametrize("missing, line", MISSING, ids=[m.split("/")[-1] for m, _ in MISSING])
def test_a_missing_download_is_named_with_its_own_link_in_one_line(tmp_path, capsys, missing, line):
    root = downloads(tmp_path / "nllb", missing=(missing,))
    assert main([str(root), PREFIX, "", "", "", "--need-spm"]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and len(printed.err.strip().splitlines()) == 1, printed.err
    assert line in printed.err and URLS.get(missing, "tinyurl.com/nllb200moe54bmodel") in printed.err, printed.err


def test_the_spm_model_is_needed_for_real_text_only_and_a_given_file_must_exist(tmp_path, capsys):
    root = downloads(tmp_path / "nllb", missing=(SPM,))
    assert found(capsys, root, PREFIX, "", "", "")["SPM"] == ""  # the dry run tokenises nothing
    assert main([str(root), PREFIX, str(root / "my_dict.txt"), "", ""]) == 2
    err = capsys.readouterr().err
    assert f"DICT={root / 'my_dict.txt'} is missing: download https://tinyurl.com/nllb200dictionary" in err, err
