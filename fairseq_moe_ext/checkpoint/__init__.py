"""Per-rank checkpoint sets: layout, manifests, validation, merge and reshard.

Layout, for a checkpoint that fairseq would name ``checkpoint_last.pt`` in a W-worker run:

    checkpoint_last-rank-0-of-W.pt     shared parameters + optimizer state, and rank 0's experts
    checkpoint_last-rank-r-of-W.pt     rank r's experts and their optimizer state only
    checkpoint_last.set.json           the manifest, written last and atomically

A single-process run writes fairseq's ordinary ``checkpoint_last.pt`` (all experts in one file).
Both load anywhere: a set is merged into one full state (all experts, ids in rank order), and a
full state is sliced for worker r of W' (experts ``r*E/W' ...``, optimizer state alike).

Every file carries ``state["moe"]``: which model keys and which optimizer slots belong to experts.
A set is used only if its manifest exists and every file has the recorded size and sha256 and the
recorded update number; otherwise the newest complete set in the directory is used and the reason
is logged. Nothing here imports fairseq, so the checkpoint tool's subcommands (``fairseq-moe merge`` ...)
work on any machine with torch.

Modules:
    names.py        file names: rank suffixes, manifest path, the ``.prev`` generation's name
    errors.py       the one-line errors (CheckpointError and its kinds) and their common fix
    contents.py     what a loaded state holds: a checkpoint at all, dense, whole, or one rank's part
    rank_state.py   what a save writes into each rank's file (``state["moe"]``, shared state stripped)
    safe_load.py    loading a file: allowed types, the zip CRC check, failures as one line, memory-mapped
    mapped_pages.py giving back a memory-mapped file's pages once a load for generation has read them
    manifest.py     the manifest: written atomically, read as untrusted input, checked against the files
    foreign.py      ``*.set.json`` files found in a save dir that are not ours
    resolve.py      what a name refers to on disk, the fallback to the newest complete set
    generations.py  the ``.prev`` generation a save keeps until it is complete
    keep_copy.py    hard link, or durable copy where the filesystem has no hard links
    reshard.py      merging a set, slicing a full state, writing a set, loading either layout whole
    set_writer.py   the one streaming set writer: rank files staged one at a time, the manifest last
    set_id.py       the set id of a save: derived by each worker alone, agreed on in the manifest
    save.py         the save of a set in training, as one transaction with the collectives as values
    share.py        a worker's share of a set, read without the files that hold other workers' experts
    compat.py       whether a checkpoint fits the model being resumed, and which flag to change if not
    config_value.py the one reader of config values (a Namespace, an omegaconf section, a dict)
    inspection.py   the checkpoint tool's ``inspect`` report
    staging.py      the checkpoint tool's output appears whole or not at all
    write_failure.py  a failed write (a full disk) in one line, the same for every writer
    upcycle.py      sparse upcycling: a dense checkpoint's FFNs become experts (copies) and a router
    prune.py        expert pruning: the experts routing statistics rank highest kept, router rows sliced
    sets_cli.py     the checkpoint tool's ``merge``, ``reshard`` and ``inspect`` subcommands, and what every
                    subcommand shares: refusals as one ``error:`` line, output names that must be free
    exchange_cli.py the ``import-fairseq-moe``, ``export-hf`` and ``import-hf`` subcommands
    prune_cli.py    the checkpoint tool's ``prune`` subcommand
    one_read.py     a checkpoint in one read, parts of it left unread (both imports read through it)
    hf/             export-hf / import-hf: Hugging Face NLLB-MoE out and in (its own module list)
    branch/         import-fairseq-moe: a moe/nllb-branch set in (its own module list)
    __main__.py     ``python -m fairseq_moe_ext.checkpoint``, an alias of ``fairseq-moe`` (../console.py)

Everything public is re-exported here, so callers write ``moe_ckpt.<name>``.
"""

import os  # noqa: F401 - tests patch the os functions the set code calls as moe_ckpt.os

from .contents import check_is_checkpoint, check_rank_states, check_whole, experts_held, is_dense
from .errors import (
    CheckpointError,
    CheckpointSetError,
    CheckpointWriteError,
    DamagedCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
    load_another,
)
from .generations import (
    current_manifests,
    link_previous_generation,
    remove_previous_generations,
    sets_to_protect,
    write_previous_manifest,
)
from .inspection import inspect_checkpoint
from .manifest import (
    MANIFEST_FORMAT,
    check_manifest,
    describe_file,
    file_digest,
    read_manifest,
    validate_set,
    write_manifest,
)
from .names import (
    MANIFEST_SUFFIX,
    PREVIOUS,
    RANK_SUFFIX_RE,
    base_of,
    manifest_path,
    rank_file,
    rank_suffix,
    split_rank_suffix,
)
from .rank_state import moe_metadata, strip_shared_state
from .reshard import concatenated, experts_per_key, load_full, load_set, merge_states, save_set, shard_state
from .resolve import Resolved, complete_sets, remove_other_layouts, resolve
from .safe_load import (
    CHECKPOINT_SAFE_GLOBALS,
    PICKLE_MAGIC,
    ZIP_MAGIC,
    check_file_intact,
    peek_metadata,
    refuse_if_not_a_checkpoint,
    safe_load,
    unloadable_error,
)
from .set_id import LAUNCH_ENVIRONMENT, agreed_set_id, derive_set_id  # noqa: F401
