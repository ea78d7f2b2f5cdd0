"""A code corpus from the Python standard library installed on this machine.

Takes the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (not site-packages, not test
suites), and assigns each file to train, valid or test by a hash of its path relative to the stdlib
root, so a file always lands in the same split and a split never holds part of a file. The result is
deterministic for a given Python version (another version ships other files).

Writes ``train.txt``, ``valid.txt``, ``test.txt``: files in path order, separated by a blank line,
tabs expanded to 4 spaces (fairseq splits lines on any whitespace, and a tab must not cut a token).

  python recipes/stdlib_corpus.py OUTDIR [--percent 100] [--heldout-percent 2]
"""

import argparse
import hashlib
import sysconfig
from pathlib import Path

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root: Path) -> list:
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def bucket(relative: str) -> int:
    """0..9999, fixed for a path."""
    return int(hashlib.sha256(relative.encode()).hexdigest()[:8], 16) % 10000


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--root", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--percent", type=float, default=100.0, help="use this share of the files (by path hash)")
    parser.add_argument(
        "--heldout-percent", type=float, default=2.0, help="share of the used files for each of valid and test"
    )
    args = parser.parse_args(argv)

    used = args.percent * 100
    heldout = args.heldout_percent / 100 * used
    splits = {"test": [], "valid": [], "train": []}
    for path in stdlib_files(args.root):
        relative = path.relative_to(args.root).as_posix()
        b = bucket(relative)
        if b >= used:
            continue
        split = "test" if b < heldout else "valid" if b < 2 * heldout else "train"
        splits[split].append(path)
    args.outdir.mkdir(parents=True, exist_ok=True)
    for split, paths in splits.items():
        if not paths:
            raise SystemExit(f"no files for {split}: raise --percent or --heldout-percent")
        texts = [p.read_text(encoding="utf-8", errors="replace").expandtabs(4).rstrip("\n") for p in paths]
        text = "\n\n".join(texts) + "\n"
        (args.outdir / f"{split}.txt").write_text(text, encoding="utf-8")
        print(f"{split:>5}: {len(paths):4d} files, {len(text.encode()) / 1e6:6.2f} MB, {text.count(chr(10)):7d} lines")
    print(f"from {args.root}")


if __name__ == "__main__":
    main()
