"""The routing tally behind --moe-routing-stats (moe/routing_stats.py), without fairseq: its counts
against hand counts, and the per-expert score prune ranks by."""

import pytest
import torch

from fairseq_moe_ext.moe.routing_stats import RoutingTally, expert_scores, statistics_document

PREFIX = "encoder.layers.1.fc1"


def test_a_routing_tally_counts_top1_topk_and_gate_mass_of_real_tokens_by_group():
    tally = RoutingTally()
    # 4 tokens, k=2, E=3; the third token is a pad (id E on both slots)
    index = torch.tensor([[0, 1], [2, 0], [3, 3], [0, 2]])
    gates = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.9, 0.1], [0.625, 0.375]])
    group = torch.tensor([0, 1, 0, 0])
    tally.add(PREFIX, 3, index, gates, group, ["a", "b"])
    tally.add(PREFIX, 3, index[:1], gates[:1], group[:1], ["a", "b"])  # a second batch adds up
    a, b = tally.tables[PREFIX]["a"], tally.tables[PREFIX]["b"]
    assert a.tolist() == [[3, 0, 0], [3, 2, 1], [2.125, 0.5, 0.375]]
    assert b.tolist() == [[0, 0, 1], [1, 0, 1], [0.5, 0, 0.5]]
    assert tally.tokens[PREFIX] == {"a": 3, "b": 1}
    document = statistics_document(tally, {"layers": {PREFIX: 3}}, "file x", {})
    assert document["layers"][PREFIX]["groups"]["a"]["topk"] == [3, 2, 1]
    # each group named weighs the same: shares of its own total, summed
    assert expert_scores(document, PREFIX, "topk", ["a", "b"]) == pytest.approx([0.5 + 0.5, 2 / 6, 1 / 6 + 0.5])
