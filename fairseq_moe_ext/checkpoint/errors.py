"""The errors of checkpoint handling: each is one line naming the file and the fix."""

from ..common.refusal import MoERefusal


class CheckpointError(MoERefusal, RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the file and the fix."""


class CheckpointSetError(CheckpointError):
    pass


class DamagedCheckpointError(CheckpointError):
    pass


class UnsafeCheckpointError(CheckpointError):
    pass


class NotACheckpointError(CheckpointError):
    """A .pt file that loads but holds something other than a fairseq checkpoint."""


def load_another(what: str = "it") -> str:
    """The fix for a checkpoint that cannot be loaded, whichever tool tried."""
    return f"restore {what} from a backup, or point --path / --restore-file at another checkpoint"


class CheckpointWriteError(CheckpointError):
    """A checkpoint file that could not be written (a full disk, a directory that is not writable);
    made by ``write_failure.cannot_write`` for every writer."""
