"""What an MoE refusal is: one exception type for input the plugin refuses.

A refusal is a user's input that cannot be honoured (a flag, a combination of flags, a file, a
set-up), never a bug of the plugin or of fairseq: its message is one line naming the problem, the
flag and the fix. Every error the plugin raises for such input is an ``MoERefusal``: option checks
raise ``MoEOptionError`` (also a ValueError, as they always were), checkpoint errors derive from
``checkpoint.CheckpointError``, the save-dir, criterion and out-of-memory stops from their own classes.
fairseq's command-line tools print a refusal as ``prog: error: <message>`` with exit status 2, as
argparse does (fairseq_integration/cli.py); any other exception keeps its traceback.
"""


class MoERefusal(Exception):
    """Input the plugin refuses; the message is one line naming the problem, the flag and the fix."""


class MoEOptionError(MoERefusal, ValueError):
    """An option value, or a combination of options, the plugin refuses."""


class MoESetupError(MoERefusal, RuntimeError):
    """A set-up the plugin refuses once running (the torch build, the precision options, the model)."""
