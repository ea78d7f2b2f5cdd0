"""Which checkpoint fairseq-train resumes from, and whether a damaged one may be replaced.

fairseq's own default, ``--save-dir``/checkpoint_last.pt, is the run's own state: when that set is
incomplete (a crash in a save), training goes on from the newest complete set in the save dir,
with a warning. A checkpoint the user named (``--restore-file X``, ``--continue-once``,
``--finetune-from-model``) is a choice: a damaged one is refused in one line, as ``--path`` is,
unless ``--moe-restore-fallback`` asks for the newest complete set in its directory instead.
"""

import os

from .checkpoint import CheckpointSetError, resolve


def resolve_restore(filename: str, save_dir: str, suffix: str, allow_fallback: bool):
    """checkpoint.resolve for the name fairseq's load_checkpoint passes to Trainer.load_checkpoint
    (``suffix``: this worker's checkpoint suffix, which fairseq appends to --restore-file)."""
    if filename == os.path.join(save_dir, f"checkpoint_last{suffix}.pt"):
        return resolve(filename)
    named = filename
    if suffix and filename.endswith(suffix + ".pt"):
        # fairseq appended this worker's suffix; the user named the set, whatever its world size.
        named = filename[: -len(suffix + ".pt")] + ".pt"
    if allow_fallback:
        return resolve(named)
    try:
        return resolve(named, fallback=False)
    except CheckpointSetError as refused:
        raise CheckpointSetError(
            f"{refused}, or add --moe-restore-fallback to train from the newest complete set in "
            f"{os.path.dirname(named) or '.'}"
        ) from None
