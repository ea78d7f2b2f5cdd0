"""What ``--moe-fully-sharded-experts sharded`` needs from torch's FSDP2, checked before any expert is
sharded: a torch without the two setters gets one line naming the flag and the fix, not an
AttributeError from inside the first MoE layer (the GPU machine runs an older torch than the pin)."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from fairseq_moe_ext.common.refusal import MoESetupError
from fairseq_moe_ext.parallel.expert_sharding import NEEDED_SETTERS, refuse_torch_without_setters


def test_this_torch_has_every_fsdp2_setter_that_sharding_experts_needs():
    refuse_torch_without_setters(FSDPModule)
    assert all(callable(getattr(FSDPModule, name)) for name in NEEDED_SETTERS)


def test_a_torch_without_the_setters_is_refused_in_one_line_naming_the_flag_and_the_fix():
    class OlderFSDPModule:
        set_force_sum_reduction_for_comms = FSDPModule.set_force_sum_reduction_for_comms

    with pytest.raises(MoESetupError) as refused:
        refuse_torch_without_setters(OlderFSDPModule)
    message = str(refused.value)
    assert "\n" not in message
    assert "set_reduce_scatter_unused_params" in message and torch.__version__ in message
    assert "--moe-fully-sharded-experts whole" in message
