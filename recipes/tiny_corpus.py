"""Stand-ins for downloaded corpora, for the real-data recipes' --dry-run (nothing is downloaded).

Each command writes files with the names and the format that the real preparation step leaves, so
the rest of a recipe (fairseq-preprocess, training, generation, scoring) runs unchanged:

  translation DIR --src de --tgt en --splits train,valid,test
      DIR/{split}.{src,tgt}: tokenized text with subword-nmt style "@@ " continuation markers, as
      fairseq's prepare-iwslt14.sh and Google's WMT'16 bpe32k files are; the sentences come from
      make_dialects.py (one dialect as the source language, the English-like target).
  lm DIR --files wiki.train.tokens,wiki.valid.tokens,wiki.test.tokens
      WikiText-style articles: " = Title = " headings, blank lines, one paragraph per line.
"""

import argparse
import random
from pathlib import Path

from make_dialects import DIALECTS, NOUNS, dialect_lexicons, render, sentence, target


def with_bpe_markers(line: str) -> str:
    """Split long words like subword-nmt does ("teacher" -> "tea@@ cher"), so --remove-bpe has work."""
    pieces = []
    for word in line.split():
        pieces.append(f"{word[:3]}@@ {word[3:]}" if len(word) > 5 else word)
    return " ".join(pieces)


def translation(args) -> None:
    rng = random.Random(args.seed)
    lexicons = dialect_lexicons(rng)
    dialect = list(DIALECTS)[1]  # a reordering dialect, so attention has something to learn
    args.outdir.mkdir(parents=True, exist_ok=True)
    for split, size in zip(args.splits.split(","), args.sizes):
        parses = [sentence(rng) for _ in range(size)]
        for lang, text in ((args.src, lambda p: render(p, dialect, lexicons[dialect], rng)), (args.tgt, target)):
            lines = [with_bpe_markers(text(p)) for p in parses]
            (args.outdir / f"{split}.{lang}").write_text("\n".join(lines) + "\n")


def lm(args) -> None:
    rng = random.Random(args.seed)
    args.outdir.mkdir(parents=True, exist_ok=True)
    for name, size in zip(args.files.split(","), args.sizes):
        lines = []
        for _ in range(size):
            lines += ["", f" = The {rng.choice(NOUNS)} of the {rng.choice(NOUNS)} = ", ""]
            for _ in range(rng.randint(1, 3)):
                lines.append(" " + " . ".join(target(sentence(rng)) for _ in range(rng.randint(2, 5))) + " . ")
        (args.outdir / name).write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("translation")
    t.add_argument("outdir", type=Path)
    t.add_argument("--src", required=True)
    t.add_argument("--tgt", required=True)
    t.add_argument("--splits", default="train,valid,test", help="file name stems, comma-separated")
    t.add_argument("--sizes", type=int, nargs="+", default=[1200, 60, 60], help="sentence pairs per split")
    t.add_argument("--seed", type=int, default=1)
    t.set_defaults(run=translation)
    m = sub.add_parser("lm")
    m.add_argument("outdir", type=Path)
    m.add_argument("--files", default="wiki.train.tokens,wiki.valid.tokens,wiki.test.tokens")
    m.add_argument("--sizes", type=int, nargs="+", default=[200, 12, 12], help="articles per file")
    m.add_argument("--seed", type=int, default=1)
    m.set_defaults(run=lm)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
