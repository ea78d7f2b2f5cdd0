"""The FSDP shard reader (``checkpoint/branch/fsdp_shards.py``) on shard files fairscale 0.4.13 itself wrote
(tests/requirements-fairscale.txt, test-only; tests/support/oracles/fairscale_shards.py: 2 gloo CPU workers, the branch's
wrapping and file split), not only on the files the tests write in its format."""

import pytest
import torch

from fairseq_moe_ext.checkpoint.branch.consolidated import sharded_files
from fairseq_moe_ext.checkpoint.branch.fsdp_shards import FsdpShards
from fairseq_moe_ext.checkpoint.errors import CheckpointSetError
from support.launch.dist_utils import run_on_workers
from support.oracles.fairscale_oracle import ORACLE_DIR
from support.oracles.fairscale_shards import write_both

if not (ORACLE_DIR / "fairscale").is_dir():
    pytest.skip(
        f"fairscale (tests/requirements-fairscale.txt) is not installed in {ORACLE_DIR}", allow_module_level=True
    )


@pytest.mark.slow
def test_shards_fairscale_wrote_unflatten_to_each_workers_model_bitwise(tmp_path):
    (tmp_path / "solo").mkdir()
    (tmp_path / "replicas").mkdir()
    fulls = run_on_workers(write_both, 2, str(tmp_path))
    shards = FsdpShards(str(tmp_path / "solo" / "ck"), sharded_files(str(tmp_path / "solo" / "ck")))
    shared = shards.load(shards.shared_path)["model"]
    want = {k: v for k, v in fulls[0].items() if "expert" not in k}
    assert sorted(shared) == sorted(want)  # the tied out.weight included, which fairscale drops
    assert all(torch.equal(shared[k], want[k]) for k in want)
    root = torch.load(shards.shared_files[1], weights_only=False)["shard_metadata"]["param_metadata"][0]
    assert root["params"]["flat_param_0"]["padding"] == 1  # the 55 root values: 28 + 27 and 1 of padding
    for rank, path in enumerate(shards.rank_paths):
        experts = shards.load(path)["model"]
        want = {k: v for k, v in fulls[rank].items() if "expert" in k}
        assert sorted(experts) == sorted(want) and all(torch.equal(experts[k], want[k]) for k in want)
    assert not torch.equal(*(shards.load(p)["model"]["layers.0.experts.0.0.weight"] for p in shards.rank_paths))

    replicas = FsdpShards(str(tmp_path / "replicas" / "ck"), sharded_files(str(tmp_path / "replicas" / "ck")))
    with pytest.raises(CheckpointSetError, match="an expert sharded over its replicas"):
        replicas.load(replicas.rank_paths[0])
