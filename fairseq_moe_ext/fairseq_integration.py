"""Every place where this plugin reaches into fairseq internals, in one module.

Checked against fairseq 0.12.3 (ve-fairseq==0.12.3, the same sources as fairseq-fixed==0.12.3.1) and
torch 2.13. ``install()`` runs when fairseq imports the ``--user-dir`` package, which happens before
argument parsing and before distributed initialisation, in every worker and in every fairseq CLI.
``tests/test_fairseq_integration.py`` fails if any hooked function changes under us.

Hooks:
  1. checkpoint_utils.load_checkpoint_to_cpu: torch >= 2.6 unpickles with ``weights_only=True``;
     fairseq checkpoints hold a few plain Python types beyond tensors. We allow exactly those (see
     ``CHECKPOINT_SAFE_GLOBALS``) for the duration of fairseq's load, keep the check on, and turn
     torch's multi-line refusal into one line naming the offending type.
"""

import argparse
import collections
import functools
import pickle
import re

import torch

CHECKED_FAIRSEQ_VERSIONS = ("0.12.2", "0.12.3")

# What fairseq 0.12 stores in a checkpoint besides tensors and builtins, found by loading real
# checkpoints of translation and language-model runs (see tests/test_fairseq_integration.py).
CHECKPOINT_SAFE_GLOBALS = [argparse.Namespace, collections.OrderedDict, collections.defaultdict]

_installed = False


class UnsafeCheckpointError(RuntimeError):
    pass


def _refusal(path, error) -> UnsafeCheckpointError:
    match = re.search(r"GLOBAL ([\w.]+)", str(error))
    what = match.group(1) if match else str(error).splitlines()[0]
    return UnsafeCheckpointError(
        f"refusing to load {path}: it pickles {what}, which is not among the types fairseq checkpoints "
        f"store; if you trust the file, add the type to fairseq_moe_ext.fairseq_integration."
        f"CHECKPOINT_SAFE_GLOBALS"
    )


def _wrap_load_checkpoint_to_cpu(original):
    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
            try:
                return original(path, *args, **kwargs)
            except pickle.UnpicklingError as error:
                raise _refusal(path, error) from None

    load_checkpoint_to_cpu.__wrapped_by_moe_ext__ = True
    return load_checkpoint_to_cpu


def install() -> None:
    """Install every hook once per process."""
    global _installed
    if _installed:
        return
    import fairseq
    from fairseq import checkpoint_utils

    if not fairseq.__version__.startswith(CHECKED_FAIRSEQ_VERSIONS):
        raise ImportError(
            f"fairseq_moe_ext was checked against fairseq {', '.join(CHECKED_FAIRSEQ_VERSIONS)}, found "
            f"{fairseq.__version__}: install ve-fairseq==0.12.3 (see README)"
        )
    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, "__wrapped_by_moe_ext__", False):
        checkpoint_utils.load_checkpoint_to_cpu = _wrap_load_checkpoint_to_cpu(
            checkpoint_utils.load_checkpoint_to_cpu
        )
    _installed = True
