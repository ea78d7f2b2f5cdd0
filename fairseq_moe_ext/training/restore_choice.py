"""Which checkpoint fairseq-train resumes from, and whether a damaged one may be replaced.

fairseq's own default, ``--save-dir``/checkpoint_last.pt, is the run's own state: when that set is
incomplete (a crash in a save), training goes on from the newest complete set in the save dir,
with a warning. A checkpoint the user named (``--restore-file X``, ``--continue-once``,
``--finetune-from-model``) is a choice: a damaged one is refused in one line, as ``--path`` is,
unless ``--moe-restore-fallback`` asks for the newest complete set in its directory instead.
"""

import os

from ..checkpoint import CheckpointSetError, resolve

FAIRSEQ_DEFAULT_RESTORE_FILE = "checkpoint_last.pt"  # fairseq's CheckpointConfig.restore_file default


def resolve_restore(filename: str, checkpoint_cfg, suffix: str, allow_fallback: bool):
    """checkpoint.resolve for the name fairseq's load_checkpoint passes to Trainer.load_checkpoint
    (``suffix``: this worker's checkpoint suffix, which fairseq appends to --restore-file).
    ``--restore-file save_dir/checkpoint_last.pt`` spelled out is a name the user chose too."""
    implicit = os.path.join(checkpoint_cfg.save_dir, f"checkpoint_last{suffix}.pt")
    if checkpoint_cfg.restore_file == FAIRSEQ_DEFAULT_RESTORE_FILE and filename == implicit:
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
