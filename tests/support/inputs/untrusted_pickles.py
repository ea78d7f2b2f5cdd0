"""Checkpoint files whose pickle would run a shell command: what every loader of a user's file must refuse
in one line without running it (tests/checkpoint/test_untrusted_pickles.py, tests/cli/test_bad_input_pickles.py).

The command creates a marker file; a test asserts the marker does not exist, so a loader that unpickled
the payload (``weights_only`` off in checkpoint/safe_load.py) fails the test whatever it did next.
"""

import json
import os
import shlex
from pathlib import Path

import torch

MARKER = "code_ran"
REFUSED = "it pickles posix.system, which is not among the types fairseq checkpoints store"


class RunsAShellCommand:
    """Unpickling this calls ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def plant(path: Path, marker: Path, state=None) -> None:
    """Save ``path`` again (or ``state`` there) with the payload in its extra_state."""
    if state is None:
        state = torch.load(path, weights_only=False)  # the test's own file: trusted here, and only here
    state.setdefault("extra_state", {})["payload"] = RunsAShellCommand(marker)
    torch.save(state, path)


def plant_in_set(directory: Path, rank_file: str, marker: Path) -> None:
    """The payload in one rank file of a set, its manifest entry (size, sha256) updated to match, as a
    forger would: the manifest check passes, and only the restricted unpickler stands in the way."""
    from fairseq_moe_ext.checkpoint.manifest import describe_file

    plant(directory / rank_file, marker)
    for manifest_file in directory.glob("*.set.json"):
        manifest = json.loads(manifest_file.read_text())
        for entry in manifest["files"]:
            if entry["name"] == rank_file:
                entry.update(describe_file(str(directory / rank_file)))
        manifest_file.write_text(json.dumps(manifest))
