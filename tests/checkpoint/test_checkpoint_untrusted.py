"""Checkpoint files as untrusted input, in process and fast: manifests (strict schema), rank files
(self-describing, refused out of their set) and stray files in a save dir; tests/cli/test_bad_input.py
runs the same promises through the real CLIs, tests/checkpoint/test_checkpoint_tool_output.py the tool's output."""

import json
import logging
import shutil

import pytest
import torch

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint import foreign
from support.inputs.fake_checkpoints import EXPERT_KEY, NOT_CHECKPOINTS, fingerprint, full_state

# ---------------------------------------------------------------- class 1: the manifest's schema


def _set(path_in_manifest, value):
    """A mutation setting ``manifest[a][b]... = value`` (``value`` may be a function of the manifest)."""

    def mutate(m):
        target = m
        for key in path_in_manifest[:-1]:
            target = target[key]
        target[path_in_manifest[-1]] = value(m) if callable(value) else value
        return m

    return mutate


def _drop(key):
    def mutate(m):
        del m[key]
        return m

    return mutate


SHA = "0" * 64
# fmt: off
BAD_MANIFESTS = [
    # (id, mutation of a good manifest, the field the one line names)
    ("a-json-array", lambda m: [m], "field the top level must be a JSON object, got a JSON array"),
    ("a-json-string", lambda m: "checkpoint", "field the top level must be a JSON object"),
    ("another-tools-json", lambda m: {"foo": 1}, "field format must be"),
    ("another-format-version", _set(["format"], "fairseq-moe-ext checkpoint set v2"), "field format must be"),
    ("no-name", _drop("name"), "field name must be the manifest's own base name 'checkpoint_last'"),
    ("another-sets-name", _set(["name"], "checkpoint_best"), "field name must be"),
    ("world-size-a-string", _set(["world_size"], "2"), "field world_size must be an integer >= 1, got '2'"),
    ("world-size-a-bool", _set(["world_size"], True), "field world_size must be an integer >= 1, got True"),
    ("world-size-a-float", _set(["world_size"], 2.0), "field world_size must be an integer >= 1, got 2.0"),
    ("world-size-zero", _set(["world_size"], 0), "field world_size must be an integer >= 1, got 0"),
    ("world-size-missing", _drop("world_size"), "field world_size must be an integer >= 1, got None"),
    ("world-size-above-the-files", _set(["world_size"], 4), "field files must be a list of world_size = 4 entries"),
    ("world-size-not-dividing-the-experts", _set(["world_size"], 3), "divisible by world_size 3, got 4"),
    ("negative-updates", _set(["num_updates"], -1), "field num_updates must be an integer >= 0, got -1"),
    ("updates-a-float", _set(["num_updates"], 1.5), "field num_updates must be an integer >= 0, got 1.5"),
    ("updates-missing", _drop("num_updates"), "field num_updates must be an integer >= 0, got None"),
    ("set-id-not-hex", _set(["set_id"], "not-an-id-at-all"), "field set_id must be 16 lowercase hex digits"),
    ("set-id-uppercase", _set(["set_id"], "ABCDEF0123456789"), "field set_id must be 16 lowercase hex digits"),
    ("set-id-a-number", _set(["set_id"], 5), "field set_id must be 16 lowercase hex digits, got 5"),
    ("workers-below-the-shards", _set(["workers"], 1), "field workers must be an integer multiple of world_size 2, got 1"),
    ("workers-not-a-multiple", _set(["workers"], 3), "field workers must be an integer multiple of world_size 2, got 3"),
    ("workers-a-string", _set(["workers"], "4"), "field workers must be an integer multiple of world_size 2, got '4'"),
    ("replicas-not-one-list-per-shard", lambda m: dict(m, workers=4, replicas=[[SHA, SHA]]),
     "field replicas must be a list of world_size = 2 lists"),
    ("replicas-one-digest-short", lambda m: dict(m, workers=4, replicas=[[SHA, SHA], [SHA]]),
     "field replicas[1] must be 2 sha256 digests (one per replica)"),
    ("replicas-a-digest-not-hex", lambda m: dict(m, workers=4, replicas=[[SHA, SHA], [SHA, "zz"]]),
     "field replicas[1] must be 2 sha256 digests"),
    ("experts-a-list", _set(["num_experts"], [4]), "field num_experts must be an object"),
    ("experts-zero", _set(["num_experts", EXPERT_KEY], 0), f"field num_experts['{EXPERT_KEY}'] must be an integer >= 1"),
    ("experts-not-divisible", _set(["num_experts", EXPERT_KEY], 3), "divisible by world_size 2, got 3"),
    ("experts-a-string", _set(["num_experts", EXPERT_KEY], "4"), "divisible by world_size 2, got '4'"),
    ("files-an-object", _set(["files"], {}), "field files must be a list of world_size = 2 entries, got {}"),
    ("files-missing", _drop("files"), "field files must be a list of world_size = 2 entries, got None"),
    ("one-file-for-two-workers", lambda m: dict(m, files=m["files"][:1]), "field files must be a list of world_size = 2"),
    ("three-files-for-two-workers", lambda m: dict(m, files=m["files"] + m["files"][:1]), "field files must be"),
    ("an-entry-a-string", _set(["files", 1], "checkpoint_last-rank-1-of-2.pt"), "field files[1] must be an object"),
    ("a-rank-twice", _set(["files", 1, "rank"], 0), "field files[1].rank must be a rank 0..1 listed once, got 0"),
    ("a-rank-beyond-the-world", _set(["files", 1, "rank"], 2), "field files[1].rank must be a rank 0..1 listed once"),
    ("a-negative-rank", _set(["files", 1, "rank"], -1), "field files[1].rank must be a rank 0..1 listed once, got -1"),
    ("a-rank-as-a-string", _set(["files", 1, "rank"], "1"), "field files[1].rank must be a rank 0..1 listed once"),
    ("a-rank-as-a-bool", _set(["files", 1, "rank"], True), "field files[1].rank must be a rank 0..1 listed once"),
    ("a-name-in-another-directory", _set(["files", 1, "name"], "../elsewhere/checkpoint_last-rank-1-of-2.pt"),
     "field files[1].name must be 'checkpoint_last-rank-1-of-2.pt', got '../elsewhere/checkpoint_last-rank-1-of-2.pt' "
     "(a path: a set's files must lie beside its manifest)"),
    ("an-absolute-name", _set(["files", 1, "name"], "/tmp/checkpoint_last-rank-1-of-2.pt"),
     "(a path: a set's files must lie beside its manifest)"),
    ("a-name-in-a-subdirectory", _set(["files", 1, "name"], "sub/checkpoint_last-rank-1-of-2.pt"), "(a path"),
    ("a-windows-path", _set(["files", 1, "name"], "..\\checkpoint_last-rank-1-of-2.pt"), "(a path"),
    ("a-name-with-a-nul", _set(["files", 1, "name"], "checkpoint_last-rank-1-of-2.pt\0"), "(a path"),
    ("the-dot-dot-name", _set(["files", 1, "name"], ".."), "(a path"),
    ("another-sets-file", _set(["files", 1, "name"], "checkpoint_best-rank-1-of-2.pt"),
     "field files[1].name must be 'checkpoint_last-rank-1-of-2.pt', got 'checkpoint_best-rank-1-of-2.pt'"),
    ("rank-0s-file-for-rank-1", _set(["files", 1, "name"], "checkpoint_last-rank-0-of-2.pt"), "field files[1].name"),
    ("a-name-a-number", _set(["files", 1, "name"], 7), "field files[1].name must be"),
    ("negative-bytes", _set(["files", 1, "bytes"], -1), "field files[1].bytes must be an integer >= 0, got -1"),
    ("bytes-a-string", _set(["files", 1, "bytes"], "100"), "field files[1].bytes must be an integer >= 0, got '100'"),
    ("bytes-a-bool", _set(["files", 1, "bytes"], False), "field files[1].bytes must be an integer >= 0, got False"),
    ("sha256-uppercase", _set(["files", 1, "sha256"], "A" * 64), "field files[1].sha256 must be 64 lowercase hex"),
    ("sha256-too-short", _set(["files", 1, "sha256"], SHA[:63]), "field files[1].sha256 must be 64 lowercase hex"),
    ("sha256-not-hex", _set(["files", 1, "sha256"], "g" * 64), "field files[1].sha256 must be 64 lowercase hex"),
    ("sha256-missing", lambda m: (m["files"][1].pop("sha256"), m)[1], "field files[1].sha256 must be 64 lowercase hex"),
]
# fmt: on


@pytest.mark.parametrize("case_id, mutate, field", BAD_MANIFESTS, ids=[c[0] for c in BAD_MANIFESTS])
def test_a_manifest_with_a_wrong_field_is_refused_naming_it_before_rank_files_open(
    a_set, monkeypatch, case_id, mutate, field
):
    manifest_file = a_set / "checkpoint_last.set.json"
    manifest_file.write_text(json.dumps(mutate(json.loads(manifest_file.read_text()))))

    def opened(path, *args, **kwargs):
        raise AssertionError(f"{path} was opened before the manifest was checked")

    monkeypatch.setattr(moe_ckpt, "file_digest", opened)
    monkeypatch.setattr(torch, "load", opened)
    with pytest.raises(moe_ckpt.CheckpointSetError) as refused:
        moe_ckpt.load_full(str(a_set / "checkpoint_last.pt"))
    message = str(refused.value)
    assert field in message and str(manifest_file) in message, message
    assert "\n" not in message and ("restore it from a backup" in message or "move it out of the directory" in message)


@pytest.mark.parametrize(
    "content",
    [b"", b"not json", b"\xff\xfe{", b"[" * 100000],
    ids=["empty", "not-json", "not-utf-8", "nested-too-deep"],
)
def test_a_manifest_that_is_not_json_is_refused_in_one_line(a_set, content):
    manifest_file = a_set / "checkpoint_last.set.json"
    manifest_file.write_bytes(content)
    with pytest.raises(
        moe_ckpt.CheckpointSetError,
        match=r"^cannot read manifest .*checkpoint_last.set.json: .*; "
        r"restore it from a backup",
    ) as refused:
        moe_ckpt.read_manifest(str(manifest_file))
    assert "\n" not in str(refused.value)


def test_the_previous_generations_manifest_names_its_own_files_and_passes_the_schema(a_set):
    manifest_file = str(a_set / "checkpoint_last.set.json")
    for rank in range(2):
        moe_ckpt.link_previous_generation(manifest_file, rank, 2)
    moe_ckpt.write_previous_manifest(manifest_file, 2)
    previous = moe_ckpt.validate_set(str(a_set / "checkpoint_last.prev.set.json"))
    assert previous["set_id"] == moe_ckpt.read_manifest(manifest_file)["set_id"]
    assert [f["name"] for f in previous["files"]] == [f"checkpoint_last.prev-rank-{r}-of-2.pt" for r in range(2)]


# ---------------------------------------------------------------- class 2: stray files in a save dir

# fmt: off
FOREIGN = {"another-tools.set.json": '{"foo": 1}', "a-list.set.json": "[1, 2]", "not-json.set.json": "garbage",
           "x.prev.set.json": '{"foo": 1}'}
# fmt: on


def test_foreign_manifests_in_a_save_dir_get_one_warning_each_and_stay_untouched(a_set, caplog):
    for name, text in FOREIGN.items():
        (a_set / name).write_text(text)
    outside = json.loads((a_set / "checkpoint_last.set.json").read_text())
    outside["name"] = "ours-but-elsewhere"
    outside["files"][1]["name"] = "../x/ours-but-elsewhere-rank-1-of-2.pt"
    (a_set / "ours-but-elsewhere.set.json").write_text(json.dumps(outside))
    before = fingerprint(a_set)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # two saves of one run
            assert [m["path"] for m in moe_ckpt.complete_sets(str(a_set))] == [str(a_set / "checkpoint_last.set.json")]
            assert moe_ckpt.sets_to_protect(str(a_set)) == [str(a_set / "checkpoint_last.set.json")]
    moe_ckpt.remove_previous_generations(str(a_set))
    assert fingerprint(a_set) == before
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in [*FOREIGN, "ours-but-elsewhere.set.json"]:
        assert sum(str(a_set / name) in w for w in warned) == 1, (name, warned)


@pytest.fixture(autouse=True)
def forget_warnings():
    foreign._WARNED_ABOUT.clear()
    yield
    foreign._WARNED_ABOUT.clear()


# ---------------------------------------------------------------- class 5: self-describing rank files


def test_every_rank_file_of_a_set_names_its_rank_its_experts_and_the_sets_id(a_set):
    manifest = moe_ckpt.read_manifest(str(a_set / "checkpoint_last.set.json"))
    metas = [torch.load(a_set / f"checkpoint_last-rank-{r}-of-2.pt", weights_only=True)["moe"] for r in range(2)]
    assert len(manifest["set_id"]) == 16
    assert [(m["rank"], m["world_size"], m["experts_held"], m["set_id"]) for m in metas] == [
        (0, 2, [0, 1], manifest["set_id"]),
        (1, 2, [2, 3], manifest["set_id"]),
    ]


def test_every_worker_derives_the_same_set_id_for_one_save_and_another_for_the_next():
    launch = [1, "/runs/a", "env://", "localhost", "29500", "none"]
    assert moe_ckpt.derive_set_id(8, 2, launch) == moe_ckpt.derive_set_id(8, 2, list(launch))
    assert (
        len(
            {
                moe_ckpt.derive_set_id(8, 2, launch),
                moe_ckpt.derive_set_id(9, 2, launch),
                moe_ckpt.derive_set_id(8, 4, launch),
                moe_ckpt.derive_set_id(8, 2, launch[:-1] + ["r2"]),
            }
        )
        == 4
    )


def test_workers_of_one_launch_share_a_set_id_and_another_launch_gets_another(monkeypatch):
    from types import SimpleNamespace

    from fairseq_moe_ext.training.set_identity import save_set_id

    def worker(rank):  # what differs between workers of one launch: the rank
        cfg = SimpleNamespace(
            common=SimpleNamespace(seed=1),
            checkpoint=SimpleNamespace(save_dir="ck"),
            distributed_training=SimpleNamespace(distributed_init_method="env://", distributed_rank=rank),
        )
        return SimpleNamespace(cfg=cfg, get_num_updates=lambda: 8)

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    first_launch = {save_set_id(worker(rank), 2) for rank in range(2)}
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert len(first_launch) == 1 and save_set_id(worker(0), 2) not in first_launch


def test_workers_deriving_different_set_ids_write_a_manifest_without_one_that_loads(caplog):
    from fairseq_moe_ext.checkpoint.set_id import agreed_set_id

    agreeing = [{"rank": 0, "set_id": "a" * 16}, {"rank": 1, "set_id": "a" * 16}]
    assert agreed_set_id("ck/checkpoint_last", agreeing) == "a" * 16
    assert all("set_id" not in entry for entry in agreeing)  # the manifest stores the id once
    differing = [{"rank": 0, "set_id": "a" * 16}, {"rank": 1, "set_id": "b" * 16}]
    assert agreed_set_id("ck/checkpoint_last", differing) is None
    assert "derived different set ids" in caplog.text


def test_a_rank_file_of_another_save_is_refused_even_if_an_edited_manifest_lists_it(a_set, tmp_path):
    (tmp_path / "other").mkdir()
    moe_ckpt.save_set(full_state(), str(tmp_path / "other" / "checkpoint_last"), 2)  # same contents, another save
    name = "checkpoint_last-rank-1-of-2.pt"
    shutil.copy(tmp_path / "other" / name, a_set / name)
    manifest_file = a_set / "checkpoint_last.set.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][1].update(moe_ckpt.describe_file(str(a_set / name)))
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(
        moe_ckpt.CheckpointSetError,
        match=f"{name} belongs to set [0-9a-f]{{16}}, but the manifest's "
        f"set is {manifest['set_id']}: a file from another save",
    ):
        moe_ckpt.load_full(str(a_set / "checkpoint_last.pt"))


def test_files_and_manifests_written_before_set_ids_still_load(a_set):
    manifest_file = a_set / "checkpoint_last.set.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["set_id"]
    for entry in manifest["files"]:
        path = a_set / entry["name"]
        state = torch.load(path, weights_only=True)
        del state["moe"]["set_id"], state["moe"]["experts_held"]
        torch.save(state, path)
        entry.update(moe_ckpt.describe_file(str(path)))
    manifest_file.write_text(json.dumps(manifest))
    full = moe_ckpt.load_full(str(a_set / "checkpoint_last.pt"))
    assert torch.equal(full["model"][EXPERT_KEY], full_state()["model"][EXPERT_KEY])


LONE_PART = (
    r"is one part of a checkpoint set, not a whole checkpoint: rank 1 of 2 \(set [0-9a-f]{16}, update 7, "
    r"experts 2-3\); put it back beside its set's other rank files and manifest, and pass the set's name"
)


@pytest.mark.parametrize("load", [moe_ckpt.load_full, moe_ckpt.inspect_checkpoint], ids=["load", "inspect"])
def test_a_rank_file_renamed_to_a_plain_checkpoint_name_is_refused_naming_its_set(a_set, tmp_path, load):
    shutil.copy(a_set / "checkpoint_last-rank-1-of-2.pt", tmp_path / "checkpoint_x.pt")
    with pytest.raises(moe_ckpt.CheckpointSetError, match=LONE_PART):
        load(str(tmp_path / "checkpoint_x.pt"))


def test_a_rank_file_copied_out_of_its_set_is_refused_naming_its_set_and_the_fix(a_set, tmp_path):
    (tmp_path / "alone").mkdir()
    shutil.copy(a_set / "checkpoint_last-rank-1-of-2.pt", tmp_path / "alone")
    with pytest.raises(
        moe_ckpt.CheckpointSetError,
        match=r"1 rank files \(the first is rank 1 of 2 of checkpoint_last "
        r"\(set [0-9a-f]{16}, update 7, experts 2-3\)\) but no manifest "
        r".*copy the set's other rank files and its manifest beside",
    ):
        moe_ckpt.load_full(str(tmp_path / "alone" / "checkpoint_last-rank-1-of-2.pt"))


def test_inspect_says_a_dense_checkpoint_is_dense(tmp_path):
    dense = {k: v for k, v in full_state().items() if k != "moe"}
    torch.save(dense, tmp_path / "checkpoint_best.pt")
    lines = moe_ckpt.inspect_checkpoint(str(tmp_path / "checkpoint_best.pt"))
    assert lines[-1] == "VERDICT OK: a dense fairseq checkpoint (no experts to check)"
    assert not any("every expert" in line for line in lines)


# ---------------------------------------------------------------- the same through fairseq's loader (hook 1/7)


@pytest.mark.parametrize("what", NOT_CHECKPOINTS)
def test_fairseqs_loader_refuses_a_pt_file_that_holds_no_checkpoint_in_one_line(tmp_path, what):
    import fairseq_moe_ext  # noqa: F401  (installs the hooks)
    from fairseq import checkpoint_utils

    torch.save(NOT_CHECKPOINTS[what], tmp_path / "model.pt")
    with pytest.raises(moe_ckpt.NotACheckpointError, match=r"model.pt is not a fairseq checkpoint: it holds a"):
        checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "model.pt"))


def test_fairseqs_loader_refuses_a_rank_file_under_a_plain_name_and_loads_a_whole_file(a_set, tmp_path):
    import fairseq_moe_ext  # noqa: F401  (installs the hooks)
    from fairseq import checkpoint_utils

    shutil.copy(a_set / "checkpoint_last-rank-1-of-2.pt", tmp_path / "checkpoint_x.pt")
    with pytest.raises(moe_ckpt.CheckpointSetError, match=LONE_PART):
        checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "checkpoint_x.pt"))
    torch.save(full_state(), tmp_path / "whole.pt")
    assert checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "whole.pt"))["moe"]["experts_held"] == [0, 1, 2, 3]
