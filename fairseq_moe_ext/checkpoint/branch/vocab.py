"""Does the dictionary a user will generate with fit a branch set's embedding? (``--dictionary``)

A fairseq dictionary is 4 specials (``<s> <pad> </s> <unk>``) and one symbol per line of its
``dict.txt``; the multilingual task then appends one token per language of ``--langs`` /
``--lang-dict`` (``<mask>`` too under ``--lang-tok-style mbart``), and the ``nllb`` branch, with
``--add-data-source-prefix-tags``, three data-source tags after those (``tasks/nllb_multilingual.py``
adds them here). The import compares that count with the rows of the set's embedding and says what
to pass, before anything is written. Torch-free.
"""

import os
from typing import Dict, List, Optional

from ...common.input_file import read_lines, read_text
from ..errors import CheckpointSetError

SPECIALS = 4
DATA_SOURCE_TAGS = 3
TAGS_TASK = "--task translation_multi_simple_epoch_nllb --add-data-source-prefix-tags"


def _task_option(task, name):
    return task.get(name) if isinstance(task, dict) else getattr(task, name, None)


def language_list(task, langs: Optional[str]) -> Optional[List[str]]:
    """The languages, in token order: ``langs`` (a comma list or a file) if given, else the run's ``--langs``
    / ``--lang-dict`` as its checkpoint records them (a file only if it is here)."""
    value = langs if langs is not None else _task_option(task, "langs")
    if value is None and langs is None:
        value = _task_option(task, "lang_dict")
        if value is not None and not os.path.isfile(str(value)):
            return None
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return read_languages(",".join(str(v) for v in value), "the checkpoint's --langs")
    return read_languages(str(value), "--langs")


def read_languages(value: str, flag: str = "--langs") -> List[str]:
    """The language codes of ``value``, a file or the list itself, as the ``nllb`` branch reads them and
    more: codes separated by commas and/or newlines (NLLB's ``langs.txt`` is one comma line; the branch's
    ``--langs`` reads a file's contents and splits them at commas, stock fairseq's ``--lang-dict`` reads
    one code per line). An empty list, or one naming a code twice, is refused in one line: the order of
    the list fixes the language tokens' ids."""
    source = value
    if os.path.isfile(value):
        value = read_text(value, flag, LANGS_HOLD, _refusal)
    codes = [code.strip() for line in value.splitlines() for code in line.split(",")]
    codes = [code for code in codes if code]
    if not codes:
        raise CheckpointSetError(
            f"{flag} {source}: no language in it; pass the language list the model was trained with (NLLB's "
            f"langs.txt: one line of comma-separated codes; one code per line works too) (nothing was written)"
        )
    seen = {}
    for position, code in enumerate(codes, 1):
        if code in seen:
            raise CheckpointSetError(
                f"{flag} {source}: {code} is listed twice (codes {seen[code]} and {position}): the list's order "
                f"fixes the language tokens' ids; pass the list the model was trained with, each code once "
                f"(nothing was written)"
            )
        seen[code] = position
    return codes


def dictionary_symbols(path: str) -> int:
    if not os.path.isfile(path):
        raise CheckpointSetError(f"--dictionary {path}: no such file; pass the model's dict.txt (nothing was written)")
    return sum(1 for line in read_lines(path, "--dictionary", "the model's dict.txt", _refusal) if line.strip())


LANGS_HOLD = "the model's languages in order (NLLB's langs.txt: one line of comma-separated codes)"


def _refusal(message: str) -> CheckpointSetError:
    return CheckpointSetError(f"{message} (nothing was written)")


def check_vocabulary(shared_model: Dict, task, dictionary: str, langs: Optional[str], path: str) -> List[str]:
    """NOTE lines saying which task flags give the embedding's row count; a one-line error if none does."""
    key = next((k for k in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight") if k in shared_model), None)
    if key is None:
        raise CheckpointSetError(
            f"{path} holds no embed_tokens.weight to check --dictionary against (nothing was written)"
        )
    rows = int(shared_model[key].shape[0])
    symbols = dictionary_symbols(dictionary)
    languages = language_list(task, langs)
    multilingual = languages is not None
    if not multilingual and rows != SPECIALS + symbols:
        raise CheckpointSetError(
            f"{key} has {rows} rows, {dictionary} gives {SPECIALS + symbols} (4 specials + {symbols}) and the set "
            f"records no --langs: pass the language list the model was trained with as --langs LIST_OR_FILE "
            f"(nothing was written)"
        )
    if not multilingual:
        return [f"dictionary: 4 specials + {symbols} symbols = {rows} rows, as {key} has"]
    mask = 1 if str(_task_option(task, "lang_tok_style") or "") == "mbart" else 0
    base = SPECIALS + symbols + len(languages) + mask
    counted = f"4 specials + {symbols} symbols + {len(languages)} language tokens" + (" + <mask>" if mask else "")
    if rows == base:
        return [
            f"dictionary: {counted} = {rows} rows, as {key} has: stock --task translation_multi_simple_epoch builds it"
        ]
    if rows == base + DATA_SOURCE_TAGS:
        return [
            f"dictionary: {counted} + 3 data-source tags = {rows} rows, as {key} has: generate and train with "
            f"{TAGS_TASK} (stock translation_multi_simple_epoch leaves the tags out: the model would not load)"
        ]
    raise CheckpointSetError(
        f"{key} has {rows} rows, but {dictionary} with {len(languages)} languages gives {base} ({counted}), or "
        f"{base + DATA_SOURCE_TAGS} with NLLB's 3 data-source tags: not the dictionary or language list this model "
        f"was trained with; pass its dict.txt as --dictionary and its languages, in order, as --langs (nothing was "
        f"written)"
    )
