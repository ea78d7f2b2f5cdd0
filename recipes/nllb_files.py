"""Where the NLLB-200 MoE files are, as a user unpacks the downloads: for ``recipes/nllb_moe.sh``.

    python recipes/nllb_files.py MODEL_DIR PREFIX DICT SPM LANGS [--need-spm]

prints shell assignments (``CKPT_DIR=... DICT=... SPM=... LANGS=...``) for ``eval``, or one line naming the file
that is missing and the download that holds it, with exit status 2. The release is four downloads (the links of
NLLB's README, examples/nllb/modeling/README.md on fairseq's ``nllb`` branch):

- the model, ``https://tinyurl.com/nllb200moe54bmodel``: a tarball that unpacks into a directory ``model_moe_54b/``
  holding ``<PREFIX>-shared.pt`` and ``<PREFIX>-rank-{0..255}.pt``. MODEL_DIR may be that directory or the one it
  was unpacked in;
- the dictionary, ``https://tinyurl.com/nllb200dictionary`` (``dictionary.txt``);
- the SentencePiece model, ``https://tinyurl.com/flores200sacrebleuspm``
  (``flores200_sacrebleu_tokenizer_spm.model``; Hugging Face's NLLB repositories name theirs
  ``sentencepiece.bpe.model``: give such a file as SPM);
- the language list, ``examples/nllb/modeling/scripts/flores200/langs.txt`` on fairseq's ``nllb`` branch.

An empty DICT, SPM or LANGS is looked for under its default name in MODEL_DIR, the checkpoints' directory and the
directory above it; one given must exist. SPM is checked only with ``--need-spm`` (generation on real text).
"""

import argparse
import os
import shlex
import sys

TARBALL_DIR = "model_moe_54b"
# fmt: off
DOWNLOADS = {
    "model": ("https://tinyurl.com/nllb200moe54bmodel (wget --trust-server-names; it unpacks into "
              f"{TARBALL_DIR}/): set MODEL_DIR to that directory or the one it was unpacked in"),
    "DICT": ("dictionary.txt", "https://tinyurl.com/nllb200dictionary"),
    "SPM": ("flores200_sacrebleu_tokenizer_spm.model", "https://tinyurl.com/flores200sacrebleuspm"),
    "LANGS": ("langs.txt", "https://raw.githubusercontent.com/facebookresearch/fairseq/nllb/examples/nllb/modeling/"
              "scripts/flores200/langs.txt"),
}
# fmt: on


def checkpoint_dir(model_dir: str, prefix: str) -> str:
    for candidate in (model_dir, os.path.join(model_dir, TARBALL_DIR)):
        if os.path.isfile(os.path.join(candidate, f"{prefix}-shared.pt")):
            return candidate
    raise LookupError(f"{os.path.join(model_dir, prefix)}-shared.pt is missing: download {DOWNLOADS['model']}")


def find(knob: str, given: str, places) -> str:
    name, url = DOWNLOADS[knob]
    if given:
        if not os.path.isfile(given):
            raise LookupError(f"{knob}={given} is missing: download {url} ({name}), or unset {knob}")
        return given
    for place in places:
        if os.path.isfile(os.path.join(place, name)):
            return os.path.join(place, name)
    raise LookupError(f"{name} is not in {' nor '.join(places)}: download {url} into MODEL_DIR, or set {knob}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("model_dir", "prefix", "dict", "spm", "langs"):
        parser.add_argument(name)
    parser.add_argument("--need-spm", action="store_true")
    args = parser.parse_args(argv)
    try:
        ckpt = checkpoint_dir(args.model_dir, args.prefix)
        if not os.path.isfile(os.path.join(ckpt, f"{args.prefix}-rank-0.pt")):
            raise LookupError(f"{os.path.join(ckpt, args.prefix)}-rank-0.pt is missing: download {DOWNLOADS['model']}")
        places = list(dict.fromkeys([args.model_dir, ckpt, os.path.dirname(os.path.abspath(ckpt))]))
        found = {"CKPT_DIR": ckpt, "DICT": find("DICT", args.dict, places), "LANGS": find("LANGS", args.langs, places)}
        found["SPM"] = find("SPM", args.spm, places) if args.need_spm else args.spm
    except LookupError as missing:
        print(f"nllb_moe.sh: {missing}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
