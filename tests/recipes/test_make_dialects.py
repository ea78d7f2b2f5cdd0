"""recipes/make_dialects.py's difficulty knob: --synonyms gives each target word several source forms per dialect."""

import random
import subprocess
import sys
from pathlib import Path

import pytest

from support.launch.paths import REPO_ROOT

RECIPES = REPO_ROOT / "recipes"
sys.path.insert(0, str(RECIPES))
import make_dialects  # noqa: E402


@pytest.mark.parametrize("synonyms", [1, 3])
def test_each_dialect_gives_every_target_word_that_many_forms_and_each_form_one_meaning(synonyms):
    lexicons = make_dialects.dialect_lexicons(random.Random(1), synonyms)
    for lexicon in lexicons.values():
        assert set(lexicon) == set(make_dialects.TARGET_WORDS)
        assert all(len(forms) == synonyms for forms in lexicon.values())
        forms = [form for word_forms in lexicon.values() for form in word_forms]
        assert len(set(forms)) == len(forms)  # a form never stands for two words in one dialect


def source_words_by_dialect(outdir: Path) -> dict:
    words = {}
    src = (outdir / "train.src").read_text().splitlines()
    for line, dialect in zip(src, (outdir / "train.domain").read_text().splitlines()):
        words.setdefault(dialect, set()).update(line.split())
    return words


def test_more_synonyms_put_more_distinct_source_words_in_the_same_number_of_sentences(tmp_path):
    for synonyms in (1, 3):
        make_dialects.main(
            [
                str(tmp_path / str(synonyms)),
                "--train",
                "300",
                "--valid",
                "2",
                "--test",
                "2",
                "--dialects",
                "2",
                "--synonyms",
                str(synonyms),
            ]
        )
    one, three = source_words_by_dialect(tmp_path / "1"), source_words_by_dialect(tmp_path / "3")
    for dialect in one:
        assert len(three[dialect]) > 2 * len(one[dialect])
    assert (tmp_path / "1" / "train.tgt").read_text().count("\n") == (tmp_path / "3" / "train.tgt").read_text().count(
        "\n"
    )


@pytest.mark.parametrize("value", ["0", "-2"])
def test_fewer_than_one_synonym_is_refused_in_one_line_naming_the_flag_and_writes_nothing(tmp_path, value):
    out = tmp_path / "corpus"
    done = subprocess.run(
        [sys.executable, str(RECIPES / "make_dialects.py"), str(out), "--synonyms", value],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert f"--synonyms must be 1 or more, got {value}" in done.stderr.splitlines()[-1]
    assert not out.exists()
