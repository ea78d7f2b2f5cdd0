"""Expert pruning without fairseq: what a pruned layer computes (checkpoint/prune.py), against the
original layer with the router's other rows masked to -inf (the oracle: a pruned router is exactly
that), and the keep counts it refuses."""

import pytest
import torch

from fairseq_moe_ext.checkpoint import moe_metadata
from fairseq_moe_ext.checkpoint.errors import CheckpointSetError
from fairseq_moe_ext.checkpoint.prune import keep_count, prune_state
from fairseq_moe_ext.moe import MoELayer, MoELayerConfig

PREFIX = "encoder.layers.1.fc1"


def layer_and_state(experts=4, k=2, **options):
    torch.manual_seed(3)
    layer = MoELayer(MoELayerConfig.of(8, 16, experts, k=k, **options)).eval()
    with torch.no_grad():
        layer.router.wg.weight.mul_(20)  # confident routing: many tokens pick differently under masking
    model = {f"{PREFIX}.{key}": value for key, value in layer.state_dict().items()}
    expert_keys = [key for key in model if ".experts." in key]
    meta = moe_metadata(list(model), expert_keys, 1, 0, 5, experts_per_worker=experts)
    full = {"model": model, "moe": meta, "last_optimizer_state": {"state": {}}, "cfg": {"model": None}}
    return layer, full


def pruned_layer(full, kept, k=2, **options):
    state = prune_state(full, {PREFIX: kept}, {"kept": kept})
    layer = MoELayer(MoELayerConfig.of(8, 16, len(kept), k=k, **options)).eval()
    layer.load_state_dict({key[len(PREFIX) + 1 :]: value for key, value in state["model"].items()})
    return layer, state


@pytest.mark.parametrize("kept", [[1, 3], [0, 2, 3]])
@pytest.mark.parametrize("normalize", [False, True])
def test_pruning_to_some_experts_equals_the_router_masked_to_minus_infinity(kept, normalize):
    original, full = layer_and_state(normalize_gates=normalize)
    pruned, _ = pruned_layer(full, kept, normalize_gates=normalize)
    mask = torch.full((4,), float("-inf"))
    mask[kept] = 0.0
    logits = original.router.compute_logits
    original.router.compute_logits = lambda x: logits(x) + mask
    x = torch.randn(40, 8)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), original(x), rtol=1e-5, atol=1e-6)
        original.router.compute_logits = logits
        assert not torch.allclose(pruned(x), original(x))  # the experts dropped mattered


def test_pruning_keeping_every_expert_computes_the_original_layer_bit_for_bit():
    original, full = layer_and_state()
    pruned, state = pruned_layer(full, [0, 1, 2, 3])
    x = torch.randn(30, 8)
    with torch.no_grad():
        assert torch.equal(pruned(x), original(x))
    assert "last_optimizer_state" not in state and state["moe"]["optimizer_expert_slots"] == []


def test_pruning_slices_the_balance_bias_and_leaves_shared_experts_whole():
    _, full = layer_and_state(balance_bias_rate=0.001, shared_expert_count=1)
    bias_key = f"{PREFIX}.router.balance_bias.bias"
    full["model"][bias_key] = torch.arange(4.0)
    state = prune_state(full, {PREFIX: [0, 3]}, {})
    assert state["model"][bias_key].tolist() == [0.0, 3.0]
    shared = [key for key in full["model"] if ".shared_experts." in key]
    assert shared and all(torch.equal(state["model"][key], full["model"][key]) for key in shared)
    assert state["model"][f"{PREFIX}.router.wg.weight"].shape[0] == 2


@pytest.mark.parametrize(
    "keep, fraction, message",
    [(1, None, "fewer experts than the 2 each token"), (9, None, "more experts than the 8"), (None, 0.1, "(1 of 8")],
)
def test_keeping_fewer_than_k_or_more_than_e_experts_is_refused_in_one_line(keep, fraction, message):
    with pytest.raises(CheckpointSetError, match="keep") as refused:
        keep_count(8, 2, keep, fraction)
    assert message in str(refused.value) and "\n" not in str(refused.value)
