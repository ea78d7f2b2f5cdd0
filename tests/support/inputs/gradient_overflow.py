"""Mixed-precision settings and a one-off inf/NaN gradient, for the overflow tests of tests/fairseq/
(two gloo workers, and one process with balance-bias balancing)."""

import torch

# fmt: off
PRECISIONS = {
    "amp": ["--amp", "--amp-batch-retries", "0"],
    "fp16 (not flattened)": ["--fp16", "--fp16-no-flatten-grads"],
    "memory-efficient fp16": ["--memory-efficient-fp16"],
}
# fmt: on


# Loss-free balancing on: a skipped step must neither move the bias nor keep the load it counted.
BALANCE_BIAS = ["--moe-balance", "bias", "--moe-bias-update-rate", "0.05"]


def first_expert_parameter(model):
    return next(p for p in model.parameters() if getattr(p, "expert", False))


def inject_once(parameter, value):
    """The next gradient computed for ``parameter`` becomes ``value`` everywhere; later ones are left alone."""
    fired = []

    def hook(grad):
        if fired:
            return grad
        fired.append(True)
        return torch.full_like(grad, value)

    parameter.register_hook(hook)


def inject_once_into_first_experts(model, value):
    """The next gradient of the first MoE layer's first expert weight becomes ``value`` everywhere,
    hooked when that layer's experts run forward on the tensor they use: the parameter itself, or,
    with experts sharded over their replicas, FSDP2's gathered copy (its own pre-forward hook runs
    first), whose gradient FSDP2 then reduce-scatters into the slices."""
    from fairseq_moe_ext.moe.experts import BatchedExperts

    experts = next(m for m in model.modules() if isinstance(m, BatchedExperts))
    handles = []

    def hook_the_weight_in_use(module, args):
        handles.pop().remove()
        inject_once(module.batched_fc1_w, value)

    handles.append(experts.register_forward_pre_hook(hook_the_weight_in_use))


def with_adam(argv):
    """MemoryEfficientFP16Optimizer refuses SGD; Adam for every precision, so all three compare alike."""
    argv = list(argv)
    argv[argv.index("--optimizer") + 1] = "adam"
    del argv[argv.index("--momentum") : argv.index("--momentum") + 2]
    return argv
