"""Run fairseq-generate's own entry point (``fairseq_cli.generate.cli_main``, the command line parsed as the
command parses it) several times in one process, and record the experts each run's model held.

Usage (under torchrun): python tests/support/probes/fairseq_generate_probe.py OUT_DIR RUNS_JSON <common arguments>
RUNS_JSON maps a run's name to the arguments it adds ({"greedy": ["--beam", "1"], ...}). Run NAME writes
OUT_DIR/NAME/rank{R}/generate-<subset>.txt (--results-path) and OUT_DIR/NAME/rank{R}.pt: every expert tensor
of the model generate built ({state key: tensor}), so a test can tell which experts the worker held.
"""

import json
import os
import sys

import torch


def main():
    out_dir, runs, argv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    from fairseq_cli import generate

    from fairseq import checkpoint_utils

    rank = int(os.environ.get("RANK", "0"))
    loaded = {}
    original = checkpoint_utils.load_model_ensemble

    def load_model_ensemble(*args, **kwargs):
        models, cfg = original(*args, **kwargs)
        loaded["experts"] = {k: v.detach().clone() for k, v in models[0].state_dict().items() if ".experts." in k}
        return models, cfg

    checkpoint_utils.load_model_ensemble = load_model_ensemble
    for name, extra in runs.items():
        results = os.path.join(out_dir, name, f"rank{rank}")
        sys.argv = ["fairseq-generate", *argv, *extra, "--results-path", results]
        generate.cli_main()
        torch.save(loaded.pop("experts"), os.path.join(out_dir, name, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
