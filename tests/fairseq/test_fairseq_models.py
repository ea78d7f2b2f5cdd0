"""Specification of the MoE models and criterions inside fairseq, in process.

Models are built the way fairseq-train builds them: command-line flags through fairseq's parser,
converted to its config, torch seeded with --seed, then ``task.build_model(cfg.model)``. The data
directories hold dictionaries only; batches are collated from random tokens.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from fairseq import utils
from fairseq_moe_ext.models.moe_transformer import moe_layer_names
from fairseq_moe_ext.moe import UncollectedMoELossError
from support.inputs.tiny_fairseq_models import language_model, lm_batch, translation, translation_batch

# fairseq composes its config with hydra's deprecated schema matching on every build.
pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")

# Both stacks 2 layers of width 64, ffn 128: the shape of the *_tiny MoE architectures.
# fmt: off
TINY_TRANSLATION = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
]
# fmt: on
# transformer_lm keeps input/output dims at 512 (with projections) unless they are given too.
# fmt: off
TINY_LM = ["--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-input-dim", "64",
           "--decoder-output-dim", "64", "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4"]
# fmt: on
# One expert, top-1, dropless: an MoE layer that must compute exactly its expert's FFN.
# fmt: off
ONE_EXPERT = ["--moe-expert-count", "1", "--moe-top-k", "1", "--moe-capacity-factor", "0",
              "--moe-eval-capacity-factor", "0"]
# fmt: on


def real_target_logits(model, sample, pad):
    logits = model(**sample["net_input"])[0]
    return logits[sample["target"].ne(pad)]


def test_the_gate_loss_weight_adds_only_the_balance_term_whose_gradient_reaches_routers(data):
    built = translation(
        data, "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--moe-gate-loss-wt", "0"
    )
    heavier = translation(
        data, "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--moe-gate-loss-wt", "2.5"
    ).criterion
    model, sample = built.model, translation_batch(built.task)
    model.train()

    def step(criterion):
        model.zero_grad()
        loss, _, log = criterion(model, sample)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.item(), log, grads

    light_loss, light_log, light = step(built.criterion)
    heavy_loss, heavy_log, heavy = step(heavier)

    assert heavy_log["loss"] == light_log["loss"] and heavy_log["nll_loss"] == light_log["nll_loss"]
    assert heavy_loss - light_loss == pytest.approx(2.5 * heavy_log["moe_gate_loss"], rel=1e-5)
    routers = [n for n in light if n.endswith("router.wg.weight")]
    assert sorted(routers) == ["decoder.layers.1.fc1.router.wg.weight", "encoder.layers.1.fc1.router.wg.weight"]
    for name in routers:
        assert not torch.allclose(heavy[name], light[name]), f"balance loss gradient does not reach {name}"
    # Nothing downstream of the last router can influence a balance loss.
    for name in ("decoder.output_projection.weight", "decoder.layers.1.fc1.experts.batched_fc1_w"):
        torch.testing.assert_close(heavy[name], light[name], rtol=0, atol=0, msg=name)


def load_dense_weights_into_moe(dense, moe):
    """Give ``moe`` every weight of ``dense``; each MoE layer's single expert gets the dense FFN."""
    dense_state = dense.state_dict()
    expert_source = {
        "batched_fc1_w": "fc1.weight",
        "batched_fc1_b": "fc1.bias",
        "batched_fc2_w": "fc2.weight",
        "batched_fc2_b": "fc2.bias",
    }
    state, used = {}, set()
    for name, value in moe.state_dict().items():
        if name in dense_state:
            source, tensor = name, dense_state[name]
        elif ".fc1.experts." in name:
            layer, _, param = name.partition(".fc1.experts.")
            source = f"{layer}.{expert_source[param]}"
            tensor = dense_state[source].unsqueeze(0)
        else:
            assert ".fc1.router." in name, f"{name} has no dense counterpart"
            state[name] = value  # one expert: its gate is the softmax of a single logit, 1.0
            continue
        assert tensor.shape == value.shape, name
        state[name] = tensor
        used.add(source)
    assert used == set(dense_state), f"dense weights left out: {set(dense_state) - used}"
    moe.load_state_dict(state)


@pytest.mark.parametrize("kind", ["translation", "language_model"])
def test_one_expert_top1_dropless_moe_model_computes_the_dense_transformer(data, kind):
    # gelu, not relu: applying the activation twice (layer and expert) would change the result.
    gelu = ["--activation-fn", "gelu"]
    moe_everywhere = [*ONE_EXPERT, "--moe-freq", "1"]
    if kind == "translation":
        dense = translation(data, *TINY_TRANSLATION, *gelu, arch="transformer")
        moe = translation(data, *TINY_TRANSLATION, *gelu, *moe_everywhere)
        sample, pad = translation_batch(dense.task), dense.task.tgt_dict.pad()
    else:
        dense = language_model(data, *TINY_LM, *gelu, arch="transformer_lm")
        # moe_transformer_lm, like transformer_lm, takes the config's defaults (the *_tiny
        # architectures also switch to pre-norm, as fairseq's named LM architectures do).
        moe = language_model(data, *TINY_LM, *gelu, *moe_everywhere, arch="moe_transformer_lm")
        sample, pad = lm_batch(dense.task), dense.task.dictionary.pad()
    assert len(moe_layer_names(moe.model)) == (4 if kind == "translation" else 2)
    load_dense_weights_into_moe(dense.model, moe.model)
    dense.model.eval()
    moe.model.eval()
    with torch.no_grad():
        want = real_target_logits(dense.model, sample, pad)
        got = real_target_logits(moe.model, sample, pad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "flags, encoder, decoder",
    [
        (["--moe-freq", "2"], [1, 3], [1, 3]),
        (["--moe-freq", "1"], [0, 1, 2, 3], [0, 1, 2, 3]),
        (["--moe-freq", "3"], [2], [2]),
        (["--moe-freq", "2", "--encoder-moe-freq", "0"], [], [1, 3]),
        (["--moe-freq", "4", "--decoder-moe-freq", "1"], [3], [0, 1, 2, 3]),
        (["--encoder-moe-freq", "1", "--decoder-moe-freq", "0"], [0, 1, 2, 3], []),
    ],
)
def test_moe_layers_are_those_where_index_plus_one_is_a_multiple_of_the_frequency(data, flags, encoder, decoder):
    model = translation(data, "--encoder-layers", "4", "--decoder-layers", "4", *flags).model
    expected = [f"encoder.layers.{i}.fc1" for i in encoder] + [f"decoder.layers.{i}.fc1" for i in decoder]
    assert moe_layer_names(model) == expected
    for side, moe_indices in (("encoder", encoder), ("decoder", decoder)):
        for i, layer in enumerate(getattr(model, side).layers):
            if i not in moe_indices:
                assert isinstance(layer.fc1, torch.nn.Linear), f"{side} layer {i} should stay dense"


@pytest.mark.parametrize(
    "flags, decoder", [([], [1, 3]), (["--decoder-moe-freq", "1"], [0, 1, 2, 3]), (["--moe-freq", "4"], [3])]
)
def test_language_model_moe_layers_follow_the_same_frequency_rule(data, flags, decoder):
    model = language_model(data, "--decoder-layers", "4", *flags).model
    assert moe_layer_names(model) == [f"decoder.layers.{i}.fc1" for i in decoder]


@pytest.mark.parametrize(
    "kind, flags, message",
    [
        (
            "translation",
            ["--moe-freq", "5"],
            "--moe-freq 5 places no MoE layer in this model (4 encoder layers and 4 decoder layers;",
        ),
        ("translation", ["--moe-freq", "0"], "--moe-freq 0 places no MoE layer in this model"),
        (
            "translation",
            ["--encoder-moe-freq", "0", "--decoder-moe-freq", "9"],
            "--encoder-moe-freq 0 / --decoder-moe-freq 9 places no MoE layer in this model",
        ),
        (
            "language_model",
            ["--decoder-moe-freq", "5"],
            "--decoder-moe-freq 5 places no MoE layer in this model (4 decoder layers;",
        ),
    ],
)
def test_an_moe_arch_whose_frequencies_place_no_moe_layer_is_refused_naming_the_count(data, kind, flags, message):
    build, layers = {
        "translation": (translation, ["--encoder-layers", "4", "--decoder-layers", "4"]),
        "language_model": (language_model, ["--decoder-layers", "4"]),
    }[kind]
    with pytest.raises(ValueError) as error:
        build(data, *layers, *flags)
    assert str(error.value).startswith(message), str(error.value)
    assert "use a frequency between 1 and 4, or a dense --arch (transformer, transformer_lm)" in str(error.value)
    assert "\n" not in str(error.value)


def experts_of(model, layer="decoder.layers.1.fc1"):
    return dict(model.named_modules())[layer].experts


@pytest.mark.parametrize("flags, hidden", [([], 128), (["--moe-expert-ffn-dim", "48"], 48)])
def test_expert_hidden_size_is_the_ffn_dim_unless_moe_expert_ffn_dim_is_given(data, flags, hidden):
    model = translation(data, "--moe-expert-count", "4", *flags).model
    for layer in moe_layer_names(model):
        experts = experts_of(model, layer)
        assert tuple(experts.batched_fc1_w.shape) == (4, hidden, 64)
        assert tuple(experts.batched_fc2_w.shape) == (4, 64, hidden)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_accurate", "tanh"])
def test_experts_use_the_models_activation_fn(data, activation):
    model = language_model(data, "--activation-fn", activation).model
    experts = experts_of(model)
    x = torch.randn(5, 64)
    got = experts(x, [5] + [0] * (experts.num_local_experts - 1))
    hidden = utils.get_activation_fn(activation)(F.linear(x, experts.batched_fc1_w[0], experts.batched_fc1_b[0]))
    torch.testing.assert_close(got, F.linear(hidden, experts.batched_fc2_w[0], experts.batched_fc2_b[0]))


def test_the_activation_fn_changes_the_moe_models_output(data):
    # Every layer MoE and the same seed: the two models differ only in their experts' activation.
    relu, gelu = (language_model(data, "--activation-fn", name, "--moe-freq", "1") for name in ("relu", "gelu"))
    sample, pad = lm_batch(relu.task), relu.task.dictionary.pad()
    relu.model.eval()
    gelu.model.eval()
    with torch.no_grad():
        assert not torch.allclose(
            real_target_logits(relu.model, sample, pad), real_target_logits(gelu.model, sample, pad), atol=1e-4
        )


@pytest.mark.parametrize("kind", ["translation", "language_model"])
def test_expert_initialisation_follows_seed(data, kind):
    make = translation if kind == "translation" else language_model

    def expert_weights(seed):
        return experts_of(make(data, seed=seed).model).batched_fc1_w.detach().clone()

    weights = {seed: expert_weights(seed) for seed in (0, 1, 3)}
    assert torch.equal(expert_weights(3), weights[3]), "the same --seed must give the same experts"
    assert not torch.equal(weights[3], weights[1]), "--seed does not reach the experts"
    assert not torch.equal(weights[0], weights[1]), "--seed 0 is a seed of its own"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--moe-expert-count", "4", "--moe-top-k", "5"],
            "--moe-top-k 5 exceeds --moe-expert-count 4: use --moe-top-k <= 4",
        ),
        (["--moe-expert-count", "0"], "--moe-expert-count must be a positive integer, got 0"),
        (["--moe-top-k", "0"], "--moe-top-k must be an integer >= 1, got 0"),
        (["--moe-capacity-factor", "nan"], "--moe-capacity-factor must be a finite number"),
        (["--moe-eval-capacity-factor", "inf"], "--moe-eval-capacity-factor must be a finite number"),
        (["--moe-gate-noise", "-1"], "--moe-gate-noise must be a finite number >= 0"),
        (["--moe-freq", "-1"], "--moe-freq must be an integer >= 0, got -1"),
        (["--decoder-moe-freq", "-2"], "--decoder-moe-freq must be an integer >= 0, got -2"),
        (["--moe-expert-ffn-dim", "0"], "--moe-expert-ffn-dim must be a positive integer, got 0"),
    ],
)
def test_bad_moe_flags_fail_before_building_with_one_line_naming_the_flag(data, flags, message):
    with pytest.raises(ValueError) as error:
        translation(data, *flags)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("weight", ["-0.1", "nan"])
def test_bad_moe_loss_weights_fail_with_one_line_naming_the_flag(data, weight):
    with pytest.raises(ValueError, match=r"^--moe-gate-loss-wt must be a finite number >= 0"):
        language_model(data, "--criterion", "moe_cross_entropy", "--moe-gate-loss-wt", weight)


def test_a_plain_criterion_on_an_moe_model_fails_at_the_next_training_forward(data):
    built = language_model(data, "--criterion", "cross_entropy")
    sample = lm_batch(built.task)
    built.model.train()
    loss, _, _ = built.criterion(built.model, sample)
    loss.backward()  # the first step cannot know yet that nobody will collect its balance losses
    with pytest.raises(UncollectedMoELossError, match="--criterion moe_cross_entropy"):
        built.criterion(built.model, sample)


def test_a_plain_criterion_may_evaluate_an_moe_model(data):
    built = language_model(data, "--criterion", "cross_entropy")
    sample = lm_batch(built.task)
    built.model.eval()
    with torch.no_grad():
        first = built.criterion(built.model, sample)[0]
        assert built.criterion(built.model, sample)[0] == first


def test_an_moe_criterion_on_a_dense_model_says_which_architectures_it_needs(data):
    built = language_model(data, *TINY_LM, "--criterion", "moe_cross_entropy", arch="transformer_lm")
    with pytest.raises(ValueError, match="MoE criterions need an MoE model"):
        built.criterion(built.model, lm_batch(built.task))


def test_the_moe_criterion_collects_every_moe_layer_of_the_forward_pass(data):
    built = translation(
        data, "--moe-freq", "1", "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1"
    )
    _, _, log = built.criterion(built.model, translation_batch(built.task))
    layers = sorted(key[len("moe_stat_") : -len("_num_tokens")] for key in log if key.endswith("_num_tokens"))
    assert layers == ["dec0", "dec1", "enc0", "enc1"]
    assert len(built.model.moe_cache) == 0, "collected records must not linger into the next pass"


def test_moe_deterministic_turns_on_torchs_deterministic_algorithms_for_the_run(data, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        translation(data)
        assert not torch.are_deterministic_algorithms_enabled(), "off unless asked for"
        translation(data, "--moe-deterministic")
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
