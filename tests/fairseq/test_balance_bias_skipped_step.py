"""Loss-free balancing across a skipped optimizer step, through fairseq's own Trainer in one process:
an inf injected into an expert gradient makes fp16/amp skip the step (as in
tests/fairseq/test_precision_overflow.py, whose two-worker test checks the same on two gloo workers); the
balance bias must stay where it was and the load counted for that step must be dropped, so the next
update moves the bias by its own load alone (docs/routing.md, "Balancing without an auxiliary loss")."""

import pytest
import torch

from fairseq_moe_ext.moe.balance_bias import balance_biases
from support.inputs.gradient_overflow import BALANCE_BIAS, PRECISIONS, first_expert_parameter, inject_once, with_adam
from support.launch.in_process_trainer import build_trainer, collate, sentence_pairs, training_args, write_dictionaries

RATE = float(BALANCE_BIAS[BALANCE_BIAS.index("--moe-bias-update-rate") + 1])


# amp (GradScaler) and fp16 (fairseq's dynamic loss scaler) skip by different code; memory-efficient
# fp16 shares fp16's scaler and is covered on two workers.
@pytest.mark.parametrize("precision", ["amp", "fp16 (not flattened)"])
def test_a_skipped_step_leaves_the_bias_and_the_next_update_counts_only_its_own_load(tmp_path, monkeypatch, precision):
    # fairseq 0.12 builds the logged norm of a skipped fp16 step with torch.tensor(0.0).cuda().
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    write_dictionaries(str(tmp_path))
    argv = training_args(str(tmp_path), 1, ["--clip-norm", "0", *BALANCE_BIAS, *PRECISIONS[precision]])
    task, trainer = build_trainer(with_adam(argv))
    if "--amp" in PRECISIONS[precision]:  # the real scaler on the CPU (fairseq's is CUDA-only)
        trainer.optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=trainer.cfg.common.fp16_init_scale)
    model = trainer.get_model()
    biases = [bias for bias in balance_biases(model)]
    assert len(biases) == 2
    before = [bias.bias.clone() for bias in biases]
    pairs = sentence_pairs(12)

    inject_once(first_expert_parameter(model), float("inf"))
    trainer.train_step([collate(task, pairs[:6])])
    assert trainer.get_num_updates() == 0, "the overflow should have skipped the step"
    for layer, (bias, want) in enumerate(zip(biases, before)):
        assert torch.equal(bias.bias, want), f"layer {layer}'s bias moved on a skipped step"
        assert bias.pending_load is None, f"layer {layer} kept the load of a skipped step"

    seen = [[] for _ in biases]  # the load each layer counts during the next step
    for bias, loads in zip(biases, seen):
        bias.observe = lambda load, observe=bias.observe, loads=loads: (loads.append(load.clone()), observe(load))[1]
    trainer.train_step([collate(task, pairs[6:])])
    assert trainer.get_num_updates() == 1
    for layer, (bias, want, loads) in enumerate(zip(biases, before, seen)):
        load = sum(loads).double()
        moved = want + RATE * torch.sign(load.mean() - load).float()
        assert not torch.equal(moved, want), "the case should move the bias"
        torch.testing.assert_close(bias.bias, moved, rtol=0, atol=1e-7, msg=f"layer {layer}")
