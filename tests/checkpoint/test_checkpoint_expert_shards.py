"""Sets with fewer files than workers (expert shards with replicas), and resume reading only a
worker's share of a set."""

import os

import pytest
import torch

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint import __main__ as tool
from fairseq_moe_ext.checkpoint.inspection import replica_findings
from fairseq_moe_ext.checkpoint.share import files_holding, load_share
from support.inputs.fake_checkpoints import EXPERT_KEY, full_state

EXPERTS = 8


def a_set(directory, shards, experts=EXPERTS, rows=2):
    full = full_state(experts=experts)
    if rows != 2:  # bigger experts, for counting bytes
        full["model"][EXPERT_KEY] = torch.randn(experts, rows, 3)
        full["last_optimizer_state"]["state"][1]["exp_avg"] = torch.randn(experts, rows, 3)
    return moe_ckpt.save_set(full, str(directory / "checkpoint_last"), shards)


def same_state(a, b, ignore=()):
    assert a.keys() == b.keys()
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    slots_a, slots_b = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert slots_a.keys() == slots_b.keys()
    for slot in slots_a:
        for name, value in slots_a[slot].items():
            assert torch.equal(value, slots_b[slot][name]), (slot, name)
    assert {k: v for k, v in a["moe"].items() if k not in ignore} == {
        k: v for k, v in b["moe"].items() if k not in ignore
    }


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_a_workers_share_read_alone_is_exactly_its_slice_of_the_merged_set(tmp_path, shards, workers):
    manifest = a_set(tmp_path, shards)
    merged = moe_ckpt.load_set(manifest)
    for rank in range(workers):
        same_state(load_share(manifest, rank, workers, moe_ckpt.safe_load), moe_ckpt.shard_state(merged, rank, workers))


@pytest.mark.parametrize("shards, workers", [(4, 4), (2, 4), (4, 2), (8, 2), (1, 4)])
def test_a_worker_reads_the_first_file_and_only_the_files_holding_its_experts(tmp_path, shards, workers):
    manifest = a_set(tmp_path, shards)
    for rank in range(workers):
        opened = []
        load_share(
            manifest, rank, workers, lambda path: opened.append(os.path.basename(path)) or moe_ckpt.safe_load(path)
        )
        first, last = rank * EXPERTS // workers, (rank + 1) * EXPERTS // workers - 1
        holding = {f for f in range(shards) if f * EXPERTS // shards <= last and (f + 1) * EXPERTS // shards > first}
        assert sorted(opened) == sorted(
            os.path.basename(moe_ckpt.rank_file(str(tmp_path / "checkpoint_last"), f, shards)) for f in holding | {0}
        )
        assert set(files_holding(shards, rank, workers)) == holding


def test_an_unchanged_layout_reads_two_files_per_worker_not_the_whole_set(tmp_path):
    manifest = a_set(tmp_path, 4)
    for rank in range(1, 4):
        opened = []
        load_share(manifest, rank, 4, lambda path: opened.append(path) or moe_ckpt.safe_load(path))
        assert len(opened) == 2


def test_a_manifest_whose_expert_count_disagrees_with_its_files_is_refused_before_slicing(tmp_path):
    manifest = a_set(tmp_path, 2)
    data = moe_ckpt.read_manifest(manifest)
    data["num_experts"][EXPERT_KEY] = 4  # still divisible by the shards: the schema cannot tell
    moe_ckpt.write_manifest(
        moe_ckpt.base_of(manifest), 2, data["num_updates"], data["files"], data["num_experts"], data.get("set_id")
    )
    with pytest.raises(moe_ckpt.CheckpointSetError, match="num_experts .* do not match the experts its files hold"):
        load_share(manifest, 0, 2, moe_ckpt.safe_load)


def replicated_manifest(tmp_path, digests):
    manifest = a_set(tmp_path, 2)
    data = moe_ckpt.read_manifest(manifest)
    moe_ckpt.write_manifest(
        moe_ckpt.base_of(manifest),
        2,
        data["num_updates"],
        data["files"],
        data["num_experts"],
        data.get("set_id"),
        workers=4,
        replicas=digests,
    )
    return manifest


def test_replicas_that_differed_when_saved_are_a_problem_of_their_own_and_refused_on_resume(tmp_path):
    a, b = "a" * 64, "b" * 64
    manifest = replicated_manifest(tmp_path, [[a, a], [b, a]])
    findings = replica_findings(moe_ckpt.read_manifest(manifest))
    assert findings[0] == "  saved by 4 workers: each of the 2 expert shards had 2 replicas (stored once)"
    assert findings[1].startswith("VERDICT PROBLEM: the replicas of expert shard 1 differed when saved")
    lines = moe_ckpt.inspect_checkpoint(manifest)
    assert any(line.startswith("VERDICT PROBLEM: the replicas of expert shard 1") for line in lines)
    assert any(line.startswith("VERDICT OK: every expert is distinct") for line in lines)  # the other finding
    with pytest.raises(moe_ckpt.CheckpointSetError, match=r"replicas of expert shard\(s\) \[1\] differed.*merge"):
        load_share(manifest, 0, 2, moe_ckpt.safe_load)


def test_identical_replicas_are_reported_ok_and_resume(tmp_path):
    a, b = "a" * 64, "b" * 64
    manifest = replicated_manifest(tmp_path, [[a, a], [b, b]])
    assert "VERDICT OK: every shard's replicas were identical when saved" in moe_ckpt.inspect_checkpoint(manifest)
    load_share(manifest, 1, 2, moe_ckpt.safe_load)


def test_reshard_past_the_shard_count_writes_one_file_per_shard_naming_its_workers(tmp_path, capsys):
    source = a_set(tmp_path, 2)
    out = tmp_path / "out"
    out.mkdir()
    assert (
        tool.main(
            ["reshard", source, str(out / "checkpoint_last.pt"), "--world-size", "16", "--expert-parallel-size", "4"]
        )
        == 0
    )
    written = moe_ckpt.validate_set(str(out / "checkpoint_last.set.json"))
    assert (written["world_size"], written["workers"]) == (4, 16)
    same_state(moe_ckpt.load_set(str(out / "checkpoint_last.set.json")), moe_ckpt.load_set(source), ignore=["set_id"])


def test_reshard_defaults_to_the_largest_size_dividing_workers_and_experts(tmp_path):
    source = a_set(tmp_path, 2)
    (tmp_path / "out").mkdir()
    assert tool.main(["reshard", source, str(tmp_path / "out" / "checkpoint_last.pt"), "--world-size", "12"]) == 0
    written = moe_ckpt.read_manifest(str(tmp_path / "out" / "checkpoint_last.set.json"))
    assert (written["world_size"], written.get("workers")) == (4, 12)


@pytest.mark.parametrize("size", ["3", "0", "16"])
def test_an_expert_parallel_size_not_dividing_workers_and_experts_is_refused_in_one_line(tmp_path, capsys, size):
    source = a_set(tmp_path, 2)
    (tmp_path / "out").mkdir()
    assert (
        tool.main(
            ["reshard", source, str(tmp_path / "out" / "c.pt"), "--world-size", "8", "--expert-parallel-size", size]
        )
        == 2
    )
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"--expert-parallel-size {size} must divide both --world-size 8" in error
    assert os.listdir(tmp_path / "out") == []


def bytes_read_by_this_process() -> int:
    """Bytes this process has read through read() calls (torch.load's C++ reader included)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts bytes with Linux's /proc/self/io")
def test_a_resume_through_fairseq_reads_the_first_file_and_its_own_not_the_whole_set(tmp_path, monkeypatch):
    from fairseq import checkpoint_utils
    from fairseq_moe_ext.parallel.process_state import STATE, LoadTarget

    manifest = a_set(tmp_path, 4, rows=100_000)  # ~5 MB per rank file
    files = moe_ckpt.read_manifest(manifest)["files"]
    sizes = [f["bytes"] for f in files]
    merged = moe_ckpt.load_set(manifest)
    opened, safe_load = [], moe_ckpt.safe_load
    monkeypatch.setattr(moe_ckpt, "safe_load", lambda path, *a, **k: opened.append(path) or safe_load(path, *a, **k))
    for rank in range(1, 4):
        STATE.load_targets.append(LoadTarget(rank, 4, torch.nn.Module(), None))
        opened.clear()
        try:
            before = bytes_read_by_this_process()
            state = checkpoint_utils.load_checkpoint_to_cpu(manifest)
            expert = state["model"][EXPERT_KEY].clone()  # its bytes read (the files are memory-mapped)
            read = bytes_read_by_this_process() - before
        finally:
            STATE.load_targets.pop()
        assert torch.equal(expert, moe_ckpt.shard_state(merged, rank, 4)["model"][EXPERT_KEY])
        assert [os.path.basename(p) for p in opened] == [files[0]["name"], files[rank]["name"]]
        own = sizes[0] + sizes[rank]
        # Mapped files are read by page faults, which rchar does not count: an upper bound only.
        assert read < 1.25 * own, f"rank {rank} read {read} bytes; its share is {own}, the set {sum(sizes)}"


def decide_on_workers(rank, world, refuse):
    from fairseq_moe_ext.fairseq_integration.loading import decided_on_rank_0

    calls = []

    def decide():
        calls.append(rank)
        if refuse:
            raise moe_ckpt.CheckpointSetError("checkpoint set x.set.json cannot be loaded: damaged")
        return moe_ckpt.Resolved("set", f"chosen by rank {rank}")

    try:
        return {"resolved": decided_on_rank_0(decide).path, "calls": calls}
    except moe_ckpt.CheckpointSetError as refused:
        return {"refused": str(refused), "calls": calls}


@pytest.mark.slow
@pytest.mark.parametrize("refuse", [False, True])
def test_rank_0_alone_validates_the_set_and_every_worker_follows_its_choice(refuse):
    from support.launch.dist_utils import run_on_workers

    results = run_on_workers(decide_on_workers, 2, refuse)
    assert [r["calls"] for r in results] == [[0], []]
    if refuse:
        assert all(r["refused"] == "checkpoint set x.set.json cannot be loaded: damaged" for r in results)
    else:
        assert [r["resolved"] for r in results] == ["chosen by rank 0"] * 2


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's /proc/self/maps and madvise")
def test_pages_given_back_from_a_mapped_checkpoint_are_read_again_with_the_same_bytes(tmp_path):
    from fairseq_moe_ext.checkpoint import mapped_pages

    path = tmp_path / "big.pt"
    torch.save({"w": torch.arange(8_000_000, dtype=torch.float32)}, path)  # 32 MB

    def resident_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    weight = torch.load(path, mmap=True, weights_only=True)["w"]
    total = float(weight.sum())  # every page read
    touched = resident_kib()
    assert mapped_pages.release([str(path)]) >= 32_000_000
    assert resident_kib() < touched - 20_000  # the file's pages left this process
    assert float(weight.sum()) == total and float(weight[-1]) == 7_999_999  # read again, the same bytes
    assert mapped_pages.release([str(tmp_path / "never-mapped.pt")]) == 0
