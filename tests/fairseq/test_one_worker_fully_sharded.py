"""``--ddp-backend fully_sharded`` on one worker shards nothing (fairseq wraps no model for data parallelism), so
its ``--bf16`` / ``--fp16`` keep fairseq's FP16Optimizer and its fp32 copies, as legacy_ddp does: the
memory-efficient wrapper that fully_sharded's fp32 shards step in place would step the low-precision weights
themselves (a bf16 layer norm weight of 1.0 does not move by an update of 3e-4).
"""

import pytest
import torch

from support.launch.in_process_trainer import build_trainer, collate, sentence_pairs, training_args
from support.launch.mixed_precision_steps import NAG, PRECISIONS, master_weights

pytestmark = pytest.mark.slow


def one_step(data_dir, backend, precision):
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # fairseq's logged zero norm after an fp16 overflow
    flags = ["--ddp-backend", backend, *NAG, *PRECISIONS[precision][0]]
    task, trainer = build_trainer(training_args(data_dir, 1, flags))
    trainer.train_step([collate(task, sentence_pairs(8))])
    return type(trainer.optimizer).__name__, master_weights(trainer)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fully_sharded_on_one_worker_steps_fp32_copies_as_legacy_ddp_does(data, precision):
    optimizer, stepped = one_step(data, "fully_sharded", precision)
    legacy_optimizer, legacy = one_step(data, "legacy_ddp", precision)
    assert optimizer == legacy_optimizer == "FP16Optimizer"
    assert stepped.keys() == legacy.keys()
    for name, weight in stepped.items():
        assert torch.equal(weight, legacy[name]), name
