"""A checkpoint set's manifest: written last and atomically, read as untrusted input, and checked
against the files it lists (present, the recorded size, the recorded sha256).

A manifest decides which files are opened and trusted, so every field is checked before any rank
file is opened: a hand-edited or foreign ``*.set.json`` must end in one ``CheckpointSetError``
line naming the manifest and the field, never in a traceback or in loading a file from elsewhere
(a name like ``../other_run/x.pt`` or ``/abs/x.pt``). Each file name must be exactly the one the
set's own naming gives its rank (``<manifest base>-rank-R-of-W.pt``), which also rules out paths.
"""

import hashlib
import json
import os
import re
from typing import Dict, List, Optional

from .errors import CheckpointSetError
from .names import MANIFEST_SUFFIX, manifest_path, rank_file

MANIFEST_FORMAT = "fairseq-moe-ext checkpoint set v1"
SHA256_RE = re.compile(r"[0-9a-f]{64}\Z")
SET_ID_RE = re.compile(r"[0-9a-f]{16}\Z")
# Bigger manifests than this are not ours (a 1024-worker set's manifest is ~200 kB).
MAX_MANIFEST_BYTES = 16 << 20


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def describe_file(path: str) -> Dict:
    return {"name": os.path.basename(path), "bytes": os.path.getsize(path), "sha256": file_digest(path)}


def write_manifest(
    base: str,
    world_size: int,
    num_updates: int,
    files: List[Dict],
    experts: Dict[str, int],
    set_id: Optional[str] = None,
    workers: Optional[int] = None,
    replicas: Optional[List[List[str]]] = None,
    extra: Optional[Dict] = None,
) -> str:
    """``world_size``: the set's files (expert shards); ``workers``: the run's W when it was larger (each
    shard then had W / world_size replicas, ``replicas[s]`` their expert digests, in replica order)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": os.path.basename(base),
        "world_size": world_size,
        "num_updates": num_updates,
        "num_experts": experts,
        "files": sorted(files, key=lambda f: f["rank"]),
    }
    if set_id is not None:
        manifest["set_id"] = set_id
    if workers is not None and workers != world_size:
        manifest["workers"] = workers
    if replicas is not None:
        manifest["replicas"] = replicas
    for key, value in (extra or {}).items():  # fields the checks ignore: e.g. prune's "pruned" record
        manifest.setdefault(key, value)
    path = manifest_path(base)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(path: str) -> Dict:
    """The manifest at ``path`` if it is one of ours and well-formed, else CheckpointSetError."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"larger than {MAX_MANIFEST_BYTES} bytes")
        manifest = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointSetError(
            f"cannot read manifest {path}: {_one_line(e)}; restore it from a backup, or move it out of the directory"
        ) from None
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest, path: str) -> None:
    """Raise CheckpointSetError naming the first field of ``manifest`` (read from ``path``) that is wrong."""
    if not isinstance(manifest, dict):
        _refuse(path, "the top level", f"a JSON object, got a JSON {_json_type(manifest)}", foreign=True)
    if manifest.get("format") != MANIFEST_FORMAT:
        _refuse(path, "format", f"{MANIFEST_FORMAT!r}, got {_short(manifest.get('format'))}", foreign=True)
    base = os.path.basename(path)[: -len(MANIFEST_SUFFIX)] if path.endswith(MANIFEST_SUFFIX) else None
    name = manifest.get("name")
    if name != base or base is None:
        renamed = (
            f" (a manifest keeps its set's name: was it renamed from {name}{MANIFEST_SUFFIX}?)"
            if isinstance(name, str) and not _is_path_like(name)
            else ""
        )
        _refuse(path, "name", f"the manifest's own base name {base!r}, got {_short(name)}{renamed}")
    world = manifest.get("world_size")
    if not _is_int(world) or world < 1:
        _refuse(path, "world_size", f"an integer >= 1, got {_short(world)}")
    updates = manifest.get("num_updates")
    if not _is_int(updates) or updates < 0:
        _refuse(path, "num_updates", f"an integer >= 0, got {_short(updates)}")
    if "set_id" in manifest and not (isinstance(manifest["set_id"], str) and SET_ID_RE.match(manifest["set_id"])):
        _refuse(path, "set_id", f"16 lowercase hex digits, got {_short(manifest['set_id'])}")
    experts = manifest.get("num_experts")
    if not isinstance(experts, dict):
        _refuse(path, "num_experts", f"an object of parameter name -> expert count, got {_short(experts)}")
    for key, count in experts.items():
        if not _is_int(count) or count < 1 or count % world:
            _refuse(
                path, f"num_experts[{key!r}]", f"an integer >= 1 divisible by world_size {world}, got {_short(count)}"
            )
    _check_replicas(manifest, path, world)
    files = manifest.get("files")
    if not isinstance(files, list) or len(files) != world:
        _refuse(path, "files", f"a list of world_size = {world} entries, got {_short(files)}")
    seen = set()
    for i, entry in enumerate(files):
        _check_entry(path, base, world, i, entry, seen)


def _check_replicas(manifest, path, world):
    """``workers`` (the run's W, a multiple of the set's shards) and ``replicas`` (per shard, the
    digest of each replica's experts) are optional: sets saved with one worker per shard have neither."""
    workers = manifest.get("workers", world)
    if not _is_int(workers) or workers < world or workers % world:
        _refuse(path, "workers", f"an integer multiple of world_size {world}, got {_short(workers)}")
    if "replicas" not in manifest:
        return
    replicas, copies = manifest["replicas"], workers // world
    if not isinstance(replicas, list) or len(replicas) != world:
        _refuse(path, "replicas", f"a list of world_size = {world} lists, got {_short(replicas)}")
    for shard, digests in enumerate(replicas):
        if not (
            isinstance(digests, list)
            and len(digests) == copies
            and all(isinstance(d, str) and SHA256_RE.match(d) for d in digests)
        ):
            _refuse(path, f"replicas[{shard}]", f"{copies} sha256 digests (one per replica), got {_short(digests)}")


def differing_replicas(manifest: Dict) -> List[int]:
    """The shards whose replicas held different experts when the set was saved (a training bug)."""
    return [s for s, digests in enumerate(manifest.get("replicas") or []) if len(set(digests)) > 1]


def _check_entry(path, base, world, i, entry, seen):
    field = f"files[{i}]"
    if not isinstance(entry, dict):
        _refuse(path, field, f"an object with rank, name, bytes and sha256, got {_short(entry)}")
    rank = entry.get("rank")
    if not _is_int(rank) or not 0 <= rank < world or rank in seen:
        _refuse(path, f"{field}.rank", f"a rank 0..{world - 1} listed once, got {_short(rank)}")
    seen.add(rank)
    name = entry.get("name")
    expected = os.path.basename(rank_file(base, rank, world))
    if name != expected:
        where = " (a path: a set's files must lie beside its manifest)" if _is_path_like(name) else ""
        _refuse(path, f"{field}.name", f"{expected!r}, got {_short(name, limit=400)}{where}")
    size = entry.get("bytes")
    if not _is_int(size) or size < 0:
        _refuse(path, f"{field}.bytes", f"an integer >= 0, got {_short(size)}")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not SHA256_RE.match(digest):
        _refuse(path, f"{field}.sha256", f"64 lowercase hex digits, got {_short(digest)}")


def validate_set(manifest_file: str, check_digests: bool = True) -> Dict:
    """The manifest if every rank file is present and intact, else CheckpointSetError saying why."""
    manifest = read_manifest(manifest_file)
    directory = os.path.dirname(manifest_file)
    world = manifest["world_size"]
    ranks = sorted(f["rank"] for f in manifest["files"])
    if ranks != list(range(world)):
        raise CheckpointSetError(f"{manifest_file} lists ranks {ranks}, expected 0..{world - 1}")
    for entry in manifest["files"]:
        path = os.path.join(directory, entry["name"])
        if not os.path.isfile(path):
            what = "missing" if not os.path.lexists(path) else "not a regular file"
            raise CheckpointSetError(f"rank {entry['rank']} file {path} is {what}")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointSetError(
                f"{path} has {size} bytes, the manifest records {entry['bytes']} (truncated, or replaced by "
                f"another run's file)"
            )
        if check_digests and _digest_or_refuse(path) != entry["sha256"]:
            raise CheckpointSetError(
                f"{path} does not match its sha256 in the manifest (corrupted, or replaced by another run's file)"
            )
    return manifest


def _digest_or_refuse(path: str) -> str:
    try:
        return file_digest(path)
    except OSError as e:  # a scan of the save dir during a save must not raise anything else
        raise CheckpointSetError(f"cannot read {path}: {e}") from None


def _refuse(path, field, expectation, foreign=False):
    fix = (
        "it is not a fairseq-moe-ext manifest: move it out of the directory"
        if foreign
        else "the manifest was edited or damaged: restore it from a backup, or move the set out of the directory"
    )
    raise CheckpointSetError(f"{path}: field {field} must be {expectation}; {fix}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_path_like(name) -> bool:
    return isinstance(name, str) and (
        "/" in name or "\\" in name or ".." in name or "\0" in name or os.path.isabs(name)
    )


def _json_type(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _short(value, limit=60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(error) -> str:
    return " ".join(str(error).split()) or type(error).__name__
