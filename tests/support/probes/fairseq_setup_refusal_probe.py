"""A fairseq entry point run on a torch that lacks ``torch._grouped_mm`` (torch < 2.8), with the expert matmul
asked for by name (``FAIRSEQ_MOE_EXPERT_MATMUL=grouped_mm``): the plugin refuses that set-up when it builds the
experts (``moe/torch_compat.check_grouped_mm``, an ``MoESetupError``), and every entry point must say so as it
says any refusal: one line, ``prog: error: <message>``, exit status 2 (tests/cli/test_bad_input_entry_points.py).

Usage (as a script, or under torchrun): python tests/support/probes/fairseq_setup_refusal_probe.py TOOL [ARGS]
TOOL: a module of fairseq_cli (train, generate, validate, eval_lm, interactive, hydra_train), run as
``python -m fairseq_cli.TOOL ARGS`` runs it.
"""

import os
import runpy
import sys


def main():
    import torch

    del torch._grouped_mm  # what an older torch lacks (the plugin looks it up on torch)
    os.environ["FAIRSEQ_MOE_EXPERT_MATMUL"] = "grouped_mm"
    tool = sys.argv.pop(1)
    runpy.run_module(f"fairseq_cli.{tool}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
