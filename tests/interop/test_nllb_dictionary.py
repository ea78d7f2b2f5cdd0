"""NLLB's data-source tags: ``--task translation_multi_simple_epoch_nllb --add-data-source-prefix-tags``
builds NLLB-200's dictionary (the language tokens, then <MINED_DATA> <MMT_BT_DATA> <SMT_BT_DATA>, as the
nllb branch's ``augment_dictionary`` does), and ``import-fairseq-moe --dictionary`` says which task a
set's embedding needs, or refuses in one line, writing nothing, when the dictionary does not fit it."""

import pytest
import torch

from fairseq import options, tasks
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.inputs.branch_sets import branch_options, write_branch_set
from support.inputs.tiny_fairseq_models import translation
from support.launch.fairseq_helpers import USER_DIR

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
LANGS = ["eng_Latn", "fra_Latn", "deu_Latn"]
TAGS = ["<MINED_DATA>", "<MMT_BT_DATA>", "<SMT_BT_DATA>"]


def multilingual_task(data_dir, *flags, name="translation_multi_simple_epoch_nllb"):
    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            str(data_dir),
            "--user-dir",
            USER_DIR,
            "--task",
            name,
            "--langs",
            ",".join(LANGS),
            "--lang-pairs",
            "eng_Latn-fra_Latn",
            "--source-lang",
            "eng_Latn",
            "--target-lang",
            "fra_Latn",
            "--encoder-langtok",
            "src",
            "--decoder-langtok",
            *flags,
        ],
    )
    return tasks.setup_task(args)


@pytest.fixture(scope="module")
def spm_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("nllb_dict")
    for lang in LANGS:
        (root / f"dict.{lang}.txt").write_text("".join(f"p{i} 1\n" for i in range(10)))
    return root


def test_the_nllb_task_appends_the_three_data_source_tags_right_after_the_language_tokens(spm_data):
    stock = multilingual_task(spm_data, name="translation_multi_simple_epoch").source_dictionary
    nllb = multilingual_task(spm_data, "--add-data-source-prefix-tags")
    tagged = nllb.source_dictionary
    assert len(stock) == 4 + 10 + len(LANGS) and len(tagged) == len(stock) + 3
    assert tagged.symbols[: len(stock)] == stock.symbols  # every token before the tags keeps its id
    assert tagged.symbols[len(stock) :] == TAGS and stock.symbols[-1] == f"__{LANGS[-1]}__"
    assert nllb.target_dictionary is tagged or nllb.target_dictionary.symbols == tagged.symbols
    untagged = multilingual_task(spm_data)
    assert untagged.source_dictionary.symbols == stock.symbols  # the flag, not the task name, adds them


@pytest.fixture(scope="module")
def branch_set(data, tmp_path_factory):  # noqa: F811
    built = translation(data, "--moe-expert-count", "4")
    rows = built.model.encoder.embed_tokens.weight.shape[0]
    prefix = write_branch_set(
        tmp_path_factory.mktemp("nllb") / "ck",
        built.model.state_dict(),
        branch_options(data),
        2,
        task={
            "_name": "translation_multi_simple_epoch",
            "langs": LANGS,
            "lang_tok_style": "multilingual",
            "add_data_source_prefix_tags": True,
        },
    )
    return prefix, rows


def dictionary(path, symbols):
    path.write_text("".join(f"p{i} 1\n" for i in range(symbols)))
    return path


@pytest.mark.parametrize(
    "tags, says",
    [
        (
            3,
            "+ 3 data-source tags = {rows} rows, as encoder.embed_tokens.weight has: generate and train with "
            "--task translation_multi_simple_epoch_nllb --add-data-source-prefix-tags",
        ),
        (
            0,
            "3 language tokens = {rows} rows, as encoder.embed_tokens.weight has: stock --task "
            "translation_multi_simple_epoch builds it",
        ),
    ],
    ids=["with-the-tags", "without"],
)
def test_import_says_which_task_builds_a_dictionary_that_fits_the_embedding(branch_set, tmp_path, capsys, tags, says):
    prefix, rows = branch_set
    path = dictionary(tmp_path / "dict.txt", rows - 4 - len(LANGS) - tags)
    assert (
        checkpoint_tool(["import-fairseq-moe", str(prefix), str(tmp_path / "imported.pt"), "--dictionary", str(path)])
        == 0
    )
    assert "NOTE dictionary: " + f"4 specials + {rows - 4 - len(LANGS) - tags} symbols + " in capsys.readouterr().out
    assert (
        torch.load(tmp_path / "imported.pt", weights_only=False)["model"]["encoder.embed_tokens.weight"].shape[0]
        == rows
    )


# fmt: off
BAD_DICTIONARIES = [
    # (id, symbols in dict.txt relative to a fit without tags, --langs, the one line says)
    ("one-row-short", -1, None, "has {rows} rows, but {dict} with 3 languages gives {short}"),
    ("four-more-symbols", 4, None, "or {tags} with NLLB's 3 data-source tags: not the dictionary or language list"),
    ("another-language-list", 0, "eng_Latn,fra_Latn", "with 2 languages gives"),
    ("no-such-file", None, None, "--dictionary {dict}: no such file"),
]
# fmt: on


@pytest.mark.parametrize(
    "offset, langs, message", [row[1:] for row in BAD_DICTIONARIES], ids=[row[0] for row in BAD_DICTIONARIES]
)
def test_a_dictionary_not_fitting_the_embedding_is_refused_in_one_line_writing_nothing(
    branch_set, tmp_path, capsys, offset, langs, message
):
    prefix, rows = branch_set
    fits = rows - 4 - len(LANGS)
    path = tmp_path / "dict.txt" if offset is None else dictionary(tmp_path / "dict.txt", fits + offset)
    out = tmp_path / "out"
    out.mkdir()
    extra = ["--langs", langs] if langs else []
    code = checkpoint_tool(
        ["import-fairseq-moe", str(prefix), str(out / "imported.pt"), "--dictionary", str(path), *extra]
    )
    err = capsys.readouterr().err.strip()
    expected = message.format(rows=rows, dict=path, short=rows - 1, tags=rows + 4 + 3)
    assert code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert list(out.iterdir()) == []
