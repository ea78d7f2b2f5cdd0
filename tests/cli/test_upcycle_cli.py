"""Sparse upcycling end to end: a dense ``transformer`` trained by fairseq-train, upcycled by the
checkpoint tool (one file, and a 2-worker set) or by ``fairseq-train --moe-upcycle-from``, has the
dense model's validation loss at update 0 and trains on as an MoE on 2 workers.

The oracle is the dense checkpoint's own validation loss, computed here in one process through
fairseq's loader, task and criterion (the logs round the loss to 3 decimals).
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from fairseq_moe_ext import checkpoint as moe_ckpt
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.launch.fairseq_helpers import (
    json_logs,
    run_fairseq,
    torchrun,
    train_args,
)

pytestmark = pytest.mark.slow
FAIRSEQ_TRAIN = Path(sys.executable).parent / "fairseq-train"
# fmt: off
SHAPE = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--max-tokens", "500"]
# fmt: on
# fmt: off
MOE = ["--arch", "moe_transformer", "--criterion", "moe_label_smoothed_cross_entropy", "--moe-expert-count", "4",
       "--moe-top-k", "2", "--moe-normalize-gate", "--ddp-backend", "legacy_ddp"]
# fmt: on


@pytest.fixture(scope="module")
def dense(parallel_data, tmp_path_factory):
    """(binarized data, a dense transformer's checkpoint after 50 updates, its last training loss)."""
    root = tmp_path_factory.mktemp("upcycle")
    data = parallel_data
    output = run_fairseq(
        "train",
        *train_args(
            data,
            root / "dense",
            "--arch",
            "transformer",
            "--criterion",
            "label_smoothed_cross_entropy",
            *SHAPE,
            max_update=50,
        ),
    )
    return data, root / "dense" / "checkpoint_last.pt", float(json_logs(output, "train")[-1]["train_loss"])


def validation_loss(path, data) -> float:
    """The criterion's loss per target token over the valid set, in this process (dropout off)."""
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(data)})
    model, criterion = models[0].eval(), task.build_criterion(cfg.criterion)
    task.load_dataset("valid")
    batches = task.get_batch_iterator(task.dataset("valid"), max_tokens=4000).next_epoch_itr(shuffle=False)
    loss = tokens = 0.0
    with torch.no_grad():
        for sample in batches:
            _, sample_size, logged = criterion(model, sample)
            loss, tokens = loss + float(logged["loss"]), tokens + sample_size
    return loss / tokens / math.log(2)


def test_upcycled_to_4_experts_keeps_valid_loss_as_file_and_2_worker_set_and_trains_on(dense, tmp_path):
    data, dense_checkpoint, dense_train_loss = dense
    single, pair = tmp_path / "one" / "checkpoint_upcycled.pt", tmp_path / "two" / "checkpoint_upcycled.pt"
    single.parent.mkdir(), pair.parent.mkdir()
    assert checkpoint_tool(["upcycle", str(dense_checkpoint), str(single), "--moe-expert-count", "4"]) == 0
    # A random router picks other experts for every token: the function stays the dense one.
    assert (
        checkpoint_tool(
            [
                "upcycle",
                str(dense_checkpoint),
                str(pair),
                "--moe-expert-count",
                "4",
                "--world-size",
                "2",
                "--router-std",
                "0.1",
            ]
        )
        == 0
    )
    assert single.is_file() and (pair.parent / "checkpoint_upcycled.set.json").is_file()

    reference = validation_loss(dense_checkpoint, data)
    assert reference < 5.0  # the dense model learnt something (a uniform guess over the vocabulary is 5.6)
    assert abs(validation_loss(single, data) - reference) < 1e-5
    assert abs(validation_loss(pair, data) - reference) < 1e-5

    # The normal command: fairseq-train on 2 workers, --restore-file naming the set; update 0, fresh optimizer.
    output = torchrun(
        2,
        FAIRSEQ_TRAIN,
        train_args(
            data, tmp_path / "moe", *MOE, *SHAPE, "--log-interval", "1", "--restore-file", str(pair), max_update=6
        ),
    )
    losses = [float(r["loss"]) for r in json_logs(output)]
    assert [int(r["num_updates"]) for r in json_logs(output)][0] == 1
    assert losses[0] < dense_train_loss + 0.5, (losses, dense_train_loss)  # starts where the dense model was
    trained = moe_ckpt.load_full(str(tmp_path / "moe" / "checkpoint_last.pt"))
    assert trained["moe"]["num_updates"] == 6


def test_moe_upcycle_from_starts_two_workers_from_what_the_checkpoint_tool_upcycles(dense, tmp_path):
    """At --lr 0 the one update changes nothing, so the saved set is the model the run started from."""
    data, dense_checkpoint, _ = dense
    upcycled = tmp_path / "checkpoint_upcycled.pt"
    assert (
        checkpoint_tool(
            [
                "upcycle",
                str(dense_checkpoint),
                str(upcycled),
                "--moe-expert-count",
                "4",
                "--router-std",
                "0.1",
                "--noise",
                "0.01",
                "--seed",
                "7",
            ]
        )
        == 0
    )
    torchrun(
        2,
        FAIRSEQ_TRAIN,
        train_args(
            data,
            tmp_path / "moe",
            *MOE,
            *SHAPE,
            "--lr",
            "0",
            "--seed",
            "7",
            "--moe-upcycle-from",
            str(dense_checkpoint),
            "--moe-upcycle-router-std",
            "0.1",
            "--moe-upcycle-noise",
            "0.01",
            max_update=1,
        ),
    )
    started, expected = (
        moe_ckpt.load_full(str(tmp_path / "moe" / "checkpoint_last.pt")),
        moe_ckpt.safe_load(str(upcycled)),
    )
    assert set(started["model"]) == set(expected["model"])
    for key, value in expected["model"].items():
        assert torch.equal(started["model"][key], value), key


def test_an_upcycled_run_with_shared_part_and_router_frozen_trains_only_the_experts(dense, tmp_path):
    """--moe-freeze applies before the dense weights are loaded: the shared part ends bit for bit the dense
    model's, the router as it was initialised (the same run at --lr 0), the experts move."""
    data, dense_checkpoint, _ = dense
    flags = [*MOE, *SHAPE, "--moe-upcycle-from", str(dense_checkpoint), "--moe-freeze", "shared,router"]
    run_fairseq("train", *train_args(data, tmp_path / "moe", *flags, max_update=3))
    run_fairseq("train", *train_args(data, tmp_path / "start", *flags, "--lr", "0", max_update=1))
    trained = moe_ckpt.load_full(str(tmp_path / "moe" / "checkpoint_last.pt"))["model"]
    started = moe_ckpt.load_full(str(tmp_path / "start" / "checkpoint_last.pt"))["model"]
    dense_model = moe_ckpt.safe_load(str(dense_checkpoint))["model"]
    shared = [k for k in trained if k in dense_model and ".fc1." not in k and ".fc2." not in k]
    assert len(shared) > 10 and all(torch.equal(trained[k], dense_model[k]) for k in shared)
    routers = [k for k in trained if ".router." in k]
    assert routers and all(torch.equal(trained[k], started[k]) for k in routers)
    experts = [k for k in trained if ".experts." in k]
    assert experts and all(not torch.equal(trained[k], started[k]) for k in experts)
