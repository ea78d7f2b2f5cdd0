"""The toy language pair that the tests, the benchmarks and the GPU one-shot train on: reverse a sentence and
map every token through a fixed permutation. Learnable in a few dozen updates, so "the loss falls" is a real
check and not noise; generated from a seeded RNG, so nothing is downloaded.

Shared by tests/support/launch/fairseq_helpers.py, benchmarks/ and the GPU one-shot (benchmarks/device/oneshot_runs.py),
which import nothing from tests/.
"""

import random
from pathlib import Path
from typing import Dict, Iterable, List

VOCAB = 40
SPLITS = {"train": 600, "valid": 40, "test": 16}


def source_sentence(rng: random.Random) -> List[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))]


def translate(source: List[int]) -> str:
    """The "language pair": reverse the sentence and map every token through a fixed permutation."""
    return " ".join(f"t{(7 * i + 3) % VOCAB}" for i in reversed(source))


def write_parallel_corpus(raw: Path, seed: int = 0, splits: Dict[str, int] = SPLITS) -> Path:
    """``raw/{split}.src`` and ``raw/{split}.tgt`` for every split, ``splits[split]`` sentence pairs each."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, lines in splits.items():
        sources = [source_sentence(rng) for _ in range(lines)]
        (raw / f"{split}.src").write_text("".join(" ".join(f"s{i}" for i in s) + "\n" for s in sources))
        (raw / f"{split}.tgt").write_text("".join(translate(s) + "\n" for s in sources))
    return raw


def binarize(raw: Path, dest: Path, splits: Iterable[str] = SPLITS, language_model: bool = False) -> Path:
    """fairseq-preprocess's own main (``fairseq_cli.preprocess``, the code behind the command), run in this
    process, on ``raw/{split}.src`` and ``.tgt`` as write_parallel_corpus writes them (or ``raw/{split}.txt``
    when ``language_model``) for every split of ``splits``; the binarised corpus goes to ``dest``. fairseq is
    imported here only: writing the corpus needs none."""
    from fairseq_cli import preprocess

    from fairseq import options

    if language_model:
        corpus = ["--only-source", *(f"--{split}pref={raw / split}.txt" for split in splits)]
    else:
        corpus = ["--source-lang", "src", "--target-lang", "tgt", *(f"--{split}pref={raw / split}" for split in splits)]
    preprocess.main(options.get_preprocessing_parser().parse_args([*corpus, f"--destdir={dest}", "--workers=1"]))
    return dest
