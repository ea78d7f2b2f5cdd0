"""Every private FSDP2 attribute the plugin reads goes through common/torch_compat.py, which falls back or
refuses in one line where torch lacks it (the pin is 2.13; a lent GPU runs 2.11; users run others).

One gloo worker shards a two-layer model with the plugin's ``shard_model`` and runs a forward (FSDP2 records it
for the next backward's prefetch). With every attribute present: whether each unit reshards after forward is
FSDP2's own answer, and the recorded forwards are forgotten. Then each attribute is taken away in turn: whether a
unit reshards after forward falls back to what ``shard_model`` asked for, and generation inside training (which
must forget the recorded forwards) is refused in one line before anything is gathered.
"""

import pytest

from support.launch.dist_utils import run_on_workers

pytestmark = pytest.mark.slow


def sharded_model():
    import torch

    from fairseq_moe_ext.parallel.fully_sharded import fsdp_modules, shard_model

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    model.forward = lambda x: model.layers[1](model.layers[0](x))
    shard_model(model)
    model(torch.ones(2, 4))  # recorded for the next backward
    return model, fsdp_modules(model)


def without(owner, name):
    """Take ``name`` off ``owner`` (an instance or a class); returns how to put it back."""
    held = owner.__dict__[name]
    delattr(owner, name)
    return lambda: setattr(owner, name, held)


def removals(unit):
    """FSDP_PRIVATE_STATE's name -> (owner, attribute) to take away, on ``unit``."""
    from torch.distributed.fsdp import FSDPModule

    state = unit._get_fsdp_state()
    group = state._fsdp_param_groups[0]
    return {
        "FSDPModule._get_fsdp_state": (FSDPModule, "_get_fsdp_state"),
        "FSDPState._fsdp_param_groups": (state, "_fsdp_param_groups"),
        "FSDPParamGroup.post_forward_mesh_info": (group, "post_forward_mesh_info"),
        "FSDPParamGroup.comm_ctx.post_forward_order": (group.comm_ctx, "post_forward_order"),
        "FSDPParamGroup._post_forward_indices": (group, "_post_forward_indices"),
    }


def private_state_worker(rank, world):
    from fairseq_moe_ext.common import torch_compat
    from fairseq_moe_ext.common.refusal import MoESetupError

    model, modules = sharded_model()
    unit = next(m for m in modules if torch_compat.fsdp_param_groups(m))  # the root holds no parameter here
    result = {"present": torch_compat.fsdp_private_state(unit)}
    result["reshards"] = [torch_compat.reshards_after_forward(m) for m in modules]
    groups = torch_compat.fsdp_param_groups(unit)
    result["recorded"] = len(groups[0]._post_forward_indices)
    torch_compat.check_forward_records(modules, "generation")
    torch_compat.forget_forward_records(modules)
    result["forgotten"] = len(groups[0]._post_forward_indices)
    result["absent"] = {}
    for name, (owner, attribute) in removals(unit).items():
        put_back = without(owner, attribute)
        try:
            seen = {"probe": torch_compat.fsdp_private_state(unit)[name]}
            seen["reshards"] = [torch_compat.reshards_after_forward(m) for m in modules]
            try:
                torch_compat.check_forward_records(modules, "generation inside training")
                seen["refused"] = None
            except MoESetupError as refused:
                seen["refused"] = str(refused)
        finally:
            put_back()
        result["absent"][name] = seen
    return result


def test_each_private_fsdp2_attribute_read_falls_back_or_refuses_in_one_line_when_absent():
    from fairseq_moe_ext.common.torch_compat import FSDP_PRIVATE_STATE

    (result,) = run_on_workers(private_state_worker, 1)
    assert result["present"] == dict.fromkeys(FSDP_PRIVATE_STATE, True), "torch 2.13 has every piece"
    truth = result["reshards"]
    assert truth == [False, True, True], "the root keeps its parameters, the layers reshard after forward"
    assert result["recorded"] > 0 and result["forgotten"] == 0
    assert list(result["absent"]) == list(FSDP_PRIVATE_STATE)
    for name, seen in result["absent"].items():
        assert seen["probe"] is False, f"the probe misses the absence of {name}"
        assert seen["reshards"] == truth, f"without {name} the fallback answers {seen['reshards']}"
        if name == "FSDPParamGroup.post_forward_mesh_info":
            assert seen["refused"] is None, "nothing the recorded forwards need is missing"
            continue
        line = seen["refused"]
        assert line and "\n" not in line and line.startswith("generation inside training runs forwards"), (name, line)
        assert "--ddp-backend legacy_ddp" in line, line
