"""Each private torch API the plugin uses is looked up when used: without it the plugin either
computes the same thing another way, or refuses in one line naming what to change (a lent GPU
machine runs torch 2.11, users run others; the pin is 2.13)."""

import argparse

import pytest
import torch
import torch.nn as nn

from fairseq_moe_ext.common.torch_compat import ignore_in_ddp
from fairseq_moe_ext.moe import BatchedExperts, torch_compat
from fairseq_moe_ext.moe.cache import inside_backward
from fairseq_moe_ext.moe.grouped_mm import check_expert_matmul, grouped_mm_applies


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and ": " in message, message
    return message


def test_every_private_api_is_there_in_this_torch_and_its_probe_notices_when_one_is_gone(monkeypatch):
    assert torch_compat.missing_private_apis() == []
    monkeypatch.delattr(torch, "_foreach_mul_")
    monkeypatch.delattr(torch.nn.parallel.DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model")
    assert torch_compat.missing_private_apis() == [
        "torch._foreach_mul_",
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
    ]


def test_without_grouped_mm_auto_keeps_the_loop_and_asking_for_it_is_refused(monkeypatch):
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    weight = torch.zeros(4, 128, 64, dtype=torch.bfloat16)
    monkeypatch.delattr(torch, "_grouped_mm")
    assert not grouped_mm_applies(x, weight, capability=(9, 0))
    assert check_expert_matmul("auto") == "auto" and BatchedExperts(8, 16, 2, matmul="loop").matmul == "loop"
    with pytest.raises(RuntimeError) as refused:
        BatchedExperts(8, 16, 2, matmul="grouped_mm")
    assert "torch._grouped_mm" in one_line(refused) and "'auto' or 'loop'" in str(refused.value)


def test_without_the_graph_task_id_checkpointed_moe_layers_are_refused_in_one_line(monkeypatch):
    from fairseq_moe_ext.models.moe_layers import wrap_for_checkpointing

    layer = nn.Linear(2, 2)
    assert wrap_for_checkpointing(layer, argparse.Namespace(checkpoint_activations=True)) is layer  # fine here
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    assert inside_backward() is False
    assert wrap_for_checkpointing(layer, argparse.Namespace(checkpoint_activations=False)) is layer
    with pytest.raises(ValueError) as refused:
        wrap_for_checkpointing(nn.Linear(2, 2), argparse.Namespace(checkpoint_activations=True))
    assert "--checkpoint-activations" in one_line(refused)


def test_gradient_clipping_without_foreach_mul_scales_every_gradient_the_same_bits(monkeypatch):
    from fairseq_moe_ext.parallel.grad_norm import clip_grad_norm_

    def clipped():
        params = [nn.Parameter(torch.zeros(n)) for n in (3, 5)]
        for i, p in enumerate(params):
            p.grad = torch.arange(p.numel(), dtype=torch.float32) * (i + 1.5)
        clip_grad_norm_(params, max_norm=0.5)
        return [p.grad for p in params]

    with_foreach = clipped()
    monkeypatch.delattr(torch, "_foreach_mul_")
    without = clipped()
    assert all(torch.equal(a, b) for a, b in zip(with_foreach, without))
    assert not torch.equal(with_foreach[0], torch.arange(3.0) * 1.5)  # it did clip


def test_the_expert_relu_backward_without_the_in_place_overload_is_bit_for_bit_equal(monkeypatch):
    def gradients():
        experts = BatchedExperts(8, 16, 3, matmul="loop", seed=2)
        x = torch.randn(11, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        experts(x, [4, 0, 7]).pow(2).sum().backward()
        return [x.grad] + [p.grad for p in experts.parameters()]

    with_aten = gradients()
    monkeypatch.setattr(torch_compat, "threshold_backward_in_place", lambda: None)
    without = gradients()
    assert all(torch.equal(a, b) for a, b in zip(with_aten, without))
    h = torch.tensor([-1.0, 0.0, 2.0, float("nan")])
    assert torch.equal(torch_compat.relu_backward_(torch.ones(4), h), torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_without_ddps_private_setter_experts_are_marked_ignored_exactly_as_torch_marks_them(monkeypatch):
    def marks():
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        names = ["0.weight", "1.running_mean"]
        ignore_in_ddp(model, names)
        tensors = dict(model.named_parameters(), **dict(model.named_buffers()))
        return model._ddp_params_and_buffers_to_ignore, {
            n: getattr(t, "_ddp_ignored", False) for n, t in tensors.items()
        }

    by_torch = marks()
    monkeypatch.delattr(torch.nn.parallel.DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model")
    assert marks() == by_torch and by_torch[1]["0.weight"] and not by_torch[1]["0.bias"]


def test_amp_overflow_marking_without_per_optimizer_scaler_states_is_refused_in_one_line():
    from fairseq_moe_ext.fairseq_integration.precision import mark_overflow

    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(param.sum()).backward()
    mark_overflow(scaler, optimizer)  # this torch: the record is there and now says inf
    assert all(f.item() == 1.0 for f in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    del scaler._per_optimizer_states
    with pytest.raises(RuntimeError) as refused:
        mark_overflow(scaler, optimizer)
    assert "--fp16 or --bf16" in one_line(refused)
