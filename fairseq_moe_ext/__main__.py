"""``python -m fairseq_moe_ext <subcommand>``: the same command as ``fairseq-moe`` (console.py), e.g.
``python -m fairseq_moe_ext --user-dir`` prints the directory to pass to fairseq's ``--user-dir``."""

import sys

from .console import main as console


def main(argv=None) -> int:
    return console(argv, prog="python -m fairseq_moe_ext")


if __name__ == "__main__":
    sys.exit(main())
