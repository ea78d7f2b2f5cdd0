"""Expert-sharded inference routes every worker's batch in one MoE call, so a capacity counts the tokens of all
of them: it refuses, in one line naming the option and the override, any evaluation capacity that can drop a
slot (a capacity factor, or a token fraction below 1: measured on an imported NLLB-MoE set with a fraction of
0.25, 2 sharded workers generated other hypotheses than one process did for 3 of 6 sentences), and runs where
nothing can be dropped (a factor of 0, a token fraction of 1 or more, which replaces the factor)."""

import pytest

from fairseq_moe_ext.fairseq_integration.inference import moe_layers, refuse_capacity_drops
from support.inputs.tiny_fairseq_models import translation

# fmt: off
CASES = [
    # (flags, the refusal's words, or None: accepted)
    (("--moe-eval-capacity-factor", "1"), "pass --model-overrides \"{'moe_eval_capacity_factor': 0}\""),
    (("--moe-eval-capacity-token-fraction", "0.25"),
     "an evaluation capacity of 0.25 of the tokens counts every worker's tokens): pass --model-overrides "
     "\"{'moe_eval_capacity_token_fraction': 1.0}\", or add --moe-inference-experts local"),
    (("--moe-eval-capacity-factor", "0"), None),
    (("--moe-eval-capacity-token-fraction", "1.0"), None),
    (("--moe-eval-capacity-token-fraction", "1.5", "--moe-eval-capacity-factor", "1"), None),
]
# fmt: on


@pytest.mark.parametrize(
    "flags, refusal", CASES, ids=["factor", "fraction-0.25", "dropless", "fraction-1", "fraction-1.5"]
)
def test_sharded_inference_refuses_an_evaluation_capacity_that_can_drop_slots(data, flags, refusal):
    layers = moe_layers(translation(data, *flags).model)
    assert layers
    if refusal is None:
        refuse_capacity_drops(layers)
    else:
        with pytest.raises(ValueError, match="expert-sharded inference needs dropless routing") as refused:
            refuse_capacity_drops(layers)
        assert refusal in str(refused.value) and "\n" not in str(refused.value)
