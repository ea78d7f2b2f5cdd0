"""``python -m fairseq_moe_ext.checkpoint <subcommand>``: the same command as ``fairseq-moe`` (console.py), kept
for the command lines that spell the checkpoint tool so.

The subcommands live apart from the library so that ``-m`` runs a module the package has not imported yet
(fairseq's ``--user-dir`` import loads the library through ``fairseq_integration``).
"""

import sys


def main(argv=None) -> int:
    # The one import of checkpoint/ from a tier above: the registry of every subcommand (console.py), which
    # imports a subcommand's module only when it runs, so the checkpoint tool still runs without fairseq.
    from ..console import main as console

    return console(argv, prog="python -m fairseq_moe_ext.checkpoint")


if __name__ == "__main__":
    sys.exit(main())
