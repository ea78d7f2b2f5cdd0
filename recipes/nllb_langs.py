"""The language list of NLLB's ``langs.txt`` (or any list of codes separated by commas and/or newlines) as
the one comma-separated argument stock fairseq's ``--langs`` reads, in order.

Stock fairseq 0.12's ``translation_multi_simple_epoch`` splits ``--langs`` at commas and reads
``--lang-dict`` as one code per line, so NLLB's one-line, comma-separated ``langs.txt`` given as
``--lang-dict`` would be one language; the ``nllb`` branch read it with ``--langs`` as a file. An empty
list, or one naming a code twice, is refused in one line (exit 2), as ``import-fairseq-moe`` refuses it.

    python recipes/nllb_langs.py LANGS_FILE_OR_LIST
"""

import sys

from fairseq_moe_ext.checkpoint.branch.vocab import read_languages
from fairseq_moe_ext.checkpoint.errors import CheckpointSetError


def main(argv):
    if len(argv) != 1:
        print("usage: python recipes/nllb_langs.py LANGS_FILE_OR_LIST", file=sys.stderr)
        return 2
    try:
        print(",".join(read_languages(argv[0], "LANGS")))
    except CheckpointSetError as error:
        print(f"nllb_langs.py: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
