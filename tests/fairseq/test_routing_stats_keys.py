"""--moe-routing-stats credits each token to its own sentence's key (fairseq_integration/routing_stats.py).

One batch interleaves the groups of ``--moe-routing-stats-groups`` (its sentences' ids in another order than
its rows, the groups alternating), with sentences of different lengths, through fairseq's MoE transformer in
process: its MoE layers see tokens time-major (T x B, fairseq's layout) or, with ``--moe-batch-major-routing``,
batch-major (B x T). The counts per group are then computed by hand: each sentence's real tokens taken out
of the layer's input by position, routed by the layer's own router, and summed under that sentence's key.
A tally that maps a layer's flattened tokens to sentences in the other layout's order credits the encoder's
and the decoder's tokens to the wrong groups (and prune would keep the wrong experts).
"""

import pytest
import torch

from fairseq_moe_ext.fairseq_integration import routing_stats
from fairseq_moe_ext.models.moe_layers import MoEFeedForward
from support.inputs.tiny_fairseq_models import translation, translation_batch

LENGTHS = (7, 3, 5, 9, 4, 6)
IDS = [4, 0, 5, 2, 1, 3]  # the sentence id of each row of the batch
KEYS = ["harbor", "steppe", "harbor", "delta", "steppe", "delta"]  # by sentence id: the rows alternate groups


def layer_inputs(model):
    """Each MoE layer's input (T x B x C as fairseq hands it over) and padding mask (B x T), by name."""
    seen = {}

    def keep(name, module, args):
        seen.setdefault(name, (args[0], module.padding_mask))

    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            module.register_forward_pre_hook(lambda m, args, name=name: keep(name, m, args))
    return seen


def counted_by_hand(layer, x, padding_mask, keys_of_rows):
    """Per group: tokens, and top-1 / top-k counts and gate mass per expert, of each sentence's real tokens."""
    want = {}
    for row, key in enumerate(keys_of_rows):
        tokens = x[:, row][~padding_mask[row]] if padding_mask is not None else x[:, row]
        routing = layer.router(tokens)
        counts = want.setdefault(key, {"tokens": 0, "rows": torch.zeros(3, layer.num_experts, dtype=torch.float64)})
        counts["tokens"] += tokens.shape[0]
        counts["rows"][0] += torch.bincount(routing.expert_index[:, 0], minlength=layer.num_experts)
        counts["rows"][1] += torch.bincount(routing.expert_index.reshape(-1), minlength=layer.num_experts)
        gates = routing.gates.double().reshape(-1)
        counts["rows"][2] += torch.bincount(
            routing.expert_index.reshape(-1), weights=gates, minlength=layer.num_experts
        )
    return want


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_a_batch_mixing_groups_credits_each_layer_s_tokens_to_their_own_sentence_s_key(data, layout):
    flags = ["--moe-expert-count", "4", "--moe-top-k", "2"]
    built = translation(data, *flags, *(["--moe-batch-major-routing"] if layout == "batch-major" else []))
    model = built.model.eval()
    run = routing_stats.RoutingStatsRun(
        output="unused.json", path="unused.pt", keys=KEYS, grouped_by="file groups.txt", encoder_key="src",
        decoder_key="tgt", subset="test", tool="test",
    )  # fmt: skip
    routing_stats.attach(run, model)
    inputs = layer_inputs(model)
    sample = translation_batch(built.task, lengths=LENGTHS)
    sample["id"] = torch.tensor(IDS)  # the rows' ids (the collater sorted the rows by source length)
    routing_stats.start_batch(run, sample)
    with torch.no_grad():
        model(**sample["net_input"])
    layers = dict(model.named_modules())
    assert {name.split(".")[0] for name in inputs} == {"encoder", "decoder"}, "both sides' MoE layers ran"
    assert all(layers[name].batch_major == (layout == "batch-major") for name in inputs)
    for name, (x, mask) in inputs.items():
        assert x.shape[1] == len(IDS) and x.shape[0] > 1, (name, x.shape)
        want = counted_by_hand(layers[name], x, mask, [KEYS[i] for i in IDS])
        got, tokens = run.tally.tables[name], run.tally.tokens[name]
        assert set(got) == set(want) == set(KEYS), name
        for key, counts in want.items():
            assert tokens[key] == counts["tokens"], (name, key, tokens)
            assert got[key][:2].tolist() == counts["rows"][:2].tolist(), f"{name}, group {key}: top-1 / top-k counts"
            torch.testing.assert_close(got[key][2], counts["rows"][2], msg=f"{name}, group {key}: gate mass")
