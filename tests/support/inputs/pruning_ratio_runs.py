"""What the per-side pruning CLI tests (tests/cli/test_expert_pruning_ratio_cli.py) need beside
pruning_runs.py: a tiny set with 6 experts per MoE layer (so a ratio can prune both sides to different
counts: 2 and 4 of 6), and the oracle, generation from the unpruned set with the router logits of the
dropped experts at -inf."""

import contextlib

import torch

from support.inputs.pruning_runs import train_tiny_set


def train_six_expert_set(data, root):
    """{"data", "root", "set": a 2-worker set of moe_transformer_tiny with 6 experts, "groups": even/odd}."""
    return train_tiny_set(data, root, experts=6)


@contextlib.contextmanager
def routers_masked(kept):
    """While open, the models fairseq's load_model_ensemble returns (fairseq_cli.generate's load) add -inf to
    the router logits of every expert of MoE layer ``name`` that is not in ``kept[name]``: the original model
    computing what its pruned set should."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_model_ensemble

    def load(*args, **kwargs):
        models, cfg = original(*args, **kwargs)
        for model in models:
            for name, module in model.named_modules():
                if name in kept:
                    mask = torch.full((module.num_experts,), float("-inf"))
                    mask[kept[name]] = 0.0
                    logits = module.router.compute_logits
                    module.router.compute_logits = lambda x, logits=logits, mask=mask: logits(x) + mask.to(x)
        assert all(name in dict(model.named_modules()) for model in models for name in kept), kept
        return models, cfg

    checkpoint_utils.load_model_ensemble = load
    try:
        yield
    finally:
        checkpoint_utils.load_model_ensemble = original
