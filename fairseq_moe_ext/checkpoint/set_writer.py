"""Writing a set: the one streaming writer that ``reshard.save_set``, ``import-hf`` and
``import-fairseq-moe`` use (and a new checkpoint format's import should).

Each of them is a reader that yields the set's rank files one at a time, and ``write_shards`` writes what it
yields: every state is saved as soon as it is made and let go before the next is asked for, so one file's
state is held at a time. A reader has ``shards`` (P, the number of rank files), ``pieces(set_id)`` (a generator
of ``(rank, state)`` in rank order, each state's ``moe`` metadata naming ``set_id``) and, once the last piece
is out, ``num_updates`` and ``experts`` (expert key -> experts over the whole set) for the manifest.

``write_set`` stages the files in a directory next to the output, writes the manifest last and moves the
whole into place (``staging.write_all_or_nothing``): the set appears complete or not at all. One worker's
output (``single``) is the ordinary single file fairseq names, without a manifest (nor a set id).
"""

import os
import secrets
from typing import Callable, Dict, List, Optional

import torch

from .manifest import describe_file, write_manifest
from .names import manifest_path, rank_file
from .staging import write_all_or_nothing


class SetFiles:
    """The files of one set as they are staged in ``staging_dir``: rank files of ``base`` for ``shards``
    shards, or the one file ``single`` (a path whose name is kept) when it is given."""

    def __init__(self, staging_dir: str, base: str, shards: int, single: Optional[str] = None):
        self.staging_dir, self.base, self.shards, self.single = staging_dir, base, shards, single
        self.names: List[str] = []
        self.files: List[Dict] = []

    def save(self, rank: int, state: Dict) -> None:
        """Save ``state`` as rank ``rank``'s file and record its size and sha256 for the manifest."""
        name = os.path.basename(self.single if self.single else rank_file(self.base, rank, self.shards))
        path = os.path.join(self.staging_dir, name)
        torch.save(state, path)
        self.names.append(name)
        self.files.append(dict(describe_file(path), rank=rank))

    def finish(self, num_updates: int, experts: Dict[str, int], set_id: str, **manifest) -> List[str]:
        """Write the manifest (none for a single file) last; the names written, for the staging step.
        ``manifest``: write_manifest's optional fields (``workers``, ``extra``)."""
        if self.single:
            return list(self.names)
        staged = os.path.join(self.staging_dir, os.path.basename(self.base))
        written = write_manifest(staged, self.shards, num_updates, self.files, experts, set_id, **manifest)
        return self.names + [os.path.basename(written)]


def write_set(base: str, shards: int, fill: Callable[[SetFiles], List[str]], single: Optional[str] = None) -> str:
    """Stage what ``fill`` writes (it saves every file and returns ``SetFiles.finish()``), then move it into
    place whole; returns what a user loads: the manifest, or the single file."""
    what = single if single else f"the {shards}-file set {manifest_path(base)}"
    write_all_or_nothing(
        os.path.dirname(single or base), what, lambda staging: fill(SetFiles(staging, base, shards, single))
    )
    return single if single else manifest_path(base)


def write_shards(reader, base: str, single: Optional[str] = None, **manifest) -> str:
    """Write what ``reader`` yields (the module docstring says what a reader is) as the set of ``base`` (or as
    the one file ``single``); ``manifest``: write_manifest's optional fields (``workers``, ``extra``). Returns
    what a user loads."""
    set_id = secrets.token_hex(8)  # one writer, no workers to agree with

    def fill(files: SetFiles) -> List[str]:
        for rank, state in reader.pieces(None if single else set_id):
            files.save(rank, state)
            del state  # let go before the reader makes the next one
        return files.finish(reader.num_updates, reader.experts, set_id, **manifest)

    return write_set(base, reader.shards, fill, single)
