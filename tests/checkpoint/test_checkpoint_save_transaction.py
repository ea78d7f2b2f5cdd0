"""The checkpoint-set save as a transaction (checkpoint/save.py), run by worker threads with
in-process collectives: no fairseq, no process group. Each worker's write stands for fairseq's save
(a temporary file renamed into place, as torch_persistent_save does)."""

import json
import os
import threading

import pytest

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint.save import Collectives, SetDescription, save_rank_files, save_single_file

WORLD = 2


class ThreadGroup:
    """Collectives among ``world`` threads; ``observe(rank, event)`` runs at each one."""

    def __init__(self, world, observe=lambda rank, event: None):
        self.world, self.observe = world, observe
        self.sync = threading.Barrier(world, timeout=20)
        self.slots = [None] * world

    def for_rank(self, rank):
        def barrier():
            self.observe(rank, "barrier")
            self.sync.wait()

        def broadcast(value):
            self.observe(rank, "broadcast")
            if rank == 0:
                self.slots[0] = value
            self.sync.wait()
            out = self.slots[0]
            self.sync.wait()
            return out

        def all_gather(value):
            self.observe(rank, "all_gather")
            self.slots[rank] = value
            self.sync.wait()
            out = list(self.slots)
            self.sync.wait()
            return out

        return Collectives(rank, self.world, broadcast, all_gather, barrier)


def write_file(path, data: bytes):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def run_save(
    directory, updates, group=None, names=("checkpoint_last",), prune=(), during_write=None, world=WORLD, set_id=None
):
    """Every worker saves ``names`` (rank files holding ``updates``) and would prune the rank files
    of the sets named in ``prune``. Returns each worker's exception (None when it finished)."""
    group = group or ThreadGroup(world)
    errors = [None] * world

    def worker(rank):
        suffix = moe_ckpt.rank_suffix(rank, world)

        def write():
            for name in names:
                write_file(os.path.join(directory, f"{name}{suffix}.pt"), f"{name} {updates} {rank}".encode())
                if during_write:
                    during_write(rank, name)
            return "fairseq's result", [moe_ckpt.rank_file(os.path.join(directory, n), rank, world) for n in prune]

        describe = SetDescription(updates, {"experts": 12}, set_id(rank) if set_id else f"{updates:016x}")
        try:
            assert save_rank_files(directory, suffix, group.for_rank(rank), describe, write) == "fairseq's result"
        except BaseException as error:  # noqa: B036  (a dying worker: the others must not wait for it)
            errors[rank] = error
            group.sync.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def manifest_of(directory, name="checkpoint_last"):
    return json.loads((directory / f"{name}{moe_ckpt.MANIFEST_SUFFIX}").read_text())


def assert_loadable_and_consistent(directory):
    """What must hold at every instant of a save: some complete set validates, and no manifest of
    ours lists a file that is gone."""
    assert moe_ckpt.complete_sets(str(directory)), sorted(os.listdir(directory))
    for path in directory.glob("*" + moe_ckpt.MANIFEST_SUFFIX):
        for entry in json.loads(path.read_text())["files"]:
            assert (directory / entry["name"]).exists(), f"{path.name} lists missing {entry['name']}"


def test_a_save_ends_in_one_manifest_listing_each_rank_files_size_and_sha256(tmp_path):
    assert run_save(str(tmp_path), updates=3) == [None, None]
    manifest = moe_ckpt.validate_set(str(tmp_path / "checkpoint_last.set.json"))
    assert [f["rank"] for f in manifest["files"]] == [0, 1]
    assert (manifest["num_updates"], manifest["num_experts"], manifest["set_id"]) == (3, {"experts": 12}, f"{3:016x}")
    assert not list(tmp_path.glob("*.prev*")), "the previous generation outlived a complete save"


def test_at_every_save_step_a_complete_set_loads_and_no_manifest_lists_a_missing_file(
    tmp_path,
):
    assert run_save(str(tmp_path), updates=2, names=("checkpoint_last", "checkpoint_2")) == [None, None]
    checks = []

    def observe(rank, event):
        if rank == 0:
            assert_loadable_and_consistent(tmp_path)
            checks.append(event)

    def during_write(rank, name):
        assert_loadable_and_consistent(tmp_path)
        checks.append(f"write {name}")

    errors = run_save(
        str(tmp_path),
        updates=4,
        group=ThreadGroup(WORLD, observe),
        names=("checkpoint_last", "checkpoint_4"),
        prune=("checkpoint_2",),
        during_write=during_write,
    )
    assert errors == [None, None]
    assert_loadable_and_consistent(tmp_path)
    assert len(checks) >= 6
    assert manifest_of(tmp_path)["num_updates"] == 4
    assert not list(tmp_path.glob("checkpoint_2*")), "the pruned set was left behind"


def test_a_save_protects_first_and_writes_manifests_after_every_worker_wrote(tmp_path):
    assert run_save(str(tmp_path), updates=2) == [None, None]
    events = []

    def observe(rank, event):
        if rank == 0:
            events.append(event)

    def during_write(rank, name):
        events.append(f"write {rank}")
        previous = tmp_path / f"checkpoint_last.prev{moe_ckpt.MANIFEST_SUFFIX}"
        assert moe_ckpt.validate_set(str(previous))["num_updates"] == 2, "a file was overwritten before .prev existed"
        assert manifest_of(tmp_path)["num_updates"] == 2, "a manifest was written before every worker wrote"

    assert run_save(str(tmp_path), updates=5, group=ThreadGroup(WORLD, observe), during_write=during_write) == [
        None,
        None,
    ]
    rank0 = [e for e in events if e != "write 1"]
    assert rank0 == ["broadcast", "barrier", "barrier", "write 0", "all_gather", "barrier"]


def test_pruned_files_are_deleted_only_after_rank_0_removed_the_manifest_that_lists_them(tmp_path, monkeypatch):
    assert run_save(str(tmp_path), updates=2, names=("checkpoint_2",)) == [None, None]
    removed_while_listed = []
    real_remove = os.remove

    def remove(path):
        manifest = moe_ckpt.manifest_path(moe_ckpt.base_of(str(path)))
        if str(path).endswith(".pt") and os.path.exists(manifest):
            removed_while_listed.append(os.path.basename(str(path)))
        real_remove(path)

    monkeypatch.setattr(os, "remove", remove)
    assert run_save(str(tmp_path), updates=4, names=("checkpoint_4",), prune=("checkpoint_2",)) == [None, None]
    assert removed_while_listed == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_4-rank-0-of-2.pt",
        "checkpoint_4-rank-1-of-2.pt",
        "checkpoint_4.set.json",
    ]


def test_a_worker_that_dies_in_its_write_leaves_the_previous_set_loadable(tmp_path):
    assert run_save(str(tmp_path), updates=2) == [None, None]

    def die_after_writing(rank, name):
        if rank == 1:
            raise KeyboardInterrupt("killed")

    errors = run_save(str(tmp_path), updates=3, during_write=die_after_writing)
    assert isinstance(errors[1], KeyboardInterrupt)
    newest = moe_ckpt.complete_sets(str(tmp_path))[0]
    assert newest["num_updates"] == 2
    resolved = moe_ckpt.resolve(str(tmp_path / "checkpoint_last.pt"))
    assert resolved.fallback_reason and moe_ckpt.validate_set(resolved.path)["num_updates"] == 2


def test_a_foreign_manifest_in_the_save_dir_neither_stops_a_save_nor_is_touched(tmp_path):
    foreign = tmp_path / "other_tool.set.json"
    foreign.write_text('{"format": "another tool", "files": 3}')
    assert run_save(str(tmp_path), updates=1) == [None, None]
    assert run_save(str(tmp_path), updates=2) == [None, None]
    assert foreign.read_text() == '{"format": "another tool", "files": 3}'
    assert manifest_of(tmp_path)["num_updates"] == 2


def test_workers_that_disagree_on_the_set_id_get_a_manifest_without_one(tmp_path):
    assert run_save(str(tmp_path), updates=1, set_id=lambda rank: f"{rank:016x}") == [None, None]
    assert "set_id" not in manifest_of(tmp_path)
    moe_ckpt.validate_set(str(tmp_path / "checkpoint_last.set.json"))


def test_a_one_worker_save_replaces_the_rank_files_a_multi_worker_run_left(tmp_path):
    assert run_save(str(tmp_path), updates=2) == [None, None]
    result = save_single_file(str(tmp_path), "", lambda: write_file(str(tmp_path / "checkpoint_last.pt"), b"all"))
    assert result is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt"]


@pytest.mark.parametrize("world", [3, 4])
def test_the_transaction_runs_at_any_world_size(tmp_path, world):
    assert run_save(str(tmp_path), updates=1, world=world) == [None] * world
    assert len(moe_ckpt.validate_set(str(tmp_path / "checkpoint_last.set.json"))["files"]) == world


def test_with_replicas_the_first_of_each_shard_writes_and_the_manifest_lists_all(
    tmp_path,
):
    from fairseq_moe_ext.checkpoint.save import WorkerShare

    workers, shards = 4, 2
    group, errors = ThreadGroup(workers), [None] * workers

    def worker(rank):
        shard, replica = rank % shards, rank // shards
        suffix = moe_ckpt.rank_suffix(shard, shards)

        def write():
            if replica == 0:  # fairseq's save returns at once on the other replicas (should_save is False)
                write_file(str(tmp_path / f"checkpoint_last{suffix}.pt"), f"shard {shard}".encode())
            return None, []

        share = WorkerShare(shard, shards, writes=replica == 0, expert_digest=f"{shard:064x}")
        try:
            save_rank_files(
                str(tmp_path), suffix, group.for_rank(rank), SetDescription(5, {"experts": 12}, "0" * 16), write, share
            )
        except BaseException as error:  # noqa: B036
            errors[rank] = error
            group.sync.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(workers)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == [None] * workers
    manifest = moe_ckpt.validate_set(str(tmp_path / "checkpoint_last.set.json"))
    assert (manifest["world_size"], manifest["workers"]) == (2, 4)
    assert manifest["replicas"] == [[f"{0:064x}"] * 2, [f"{1:064x}"] * 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_last-rank-0-of-2.pt",
        "checkpoint_last-rank-1-of-2.pt",
        "checkpoint_last.set.json",
    ]
