"""``import-fairseq-moe`` on a moe-branch language model (moe_lm: ``transformer_lm``, decoder-only): a
``moe_transformer_lm`` trained and saved here is written out in the branch's file layout and options
(tests/support/inputs/branch_sets.py), imported, and scored by fairseq-eval-lm exactly as the original."""

import re

import pytest
import torch

from fairseq import checkpoint_utils
from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.inputs.branch_sets import branch_lm_options, write_branch_set
from support.inputs.tiny_fairseq_models import language_model, lm_batch
from support.launch.fairseq_helpers import USER_DIR, run_fairseq, torchrun, train_args

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")
EVAL = ["--tokens-per-sample", "32", "--max-tokens", "64", "--num-workers", "0"]  # 3 batches: 2 workers split them
# The branch's top-2 gate: gates renormalised over the two, capacity 2*ceil(S/E) in training; nothing dropped in
# evaluation (the branch sets below have --moe-eval-capacity-token-fraction 1).
BRANCH_SEMANTICS = ["--moe-normalize-gate", "--moe-capacity-factor", "1", "--moe-eval-capacity-factor", "0"]


@pytest.fixture(scope="module")
def trained(lm_data, tmp_path_factory):
    """A tiny moe_transformer_lm trained 6 updates by fairseq-train here: learned positions, tied embeddings."""
    save_dir = tmp_path_factory.mktemp("moe_lm") / "ck"
    run_fairseq(
        "train",
        *train_args(
            lm_data,
            save_dir,
            "--task",
            "language_modeling",
            "--arch",
            "moe_transformer_lm_tiny",
            "--criterion",
            "moe_cross_entropy",
            "--tokens-per-sample",
            "32",
            "--max-tokens",
            "512",
            "--required-batch-size-multiple",
            "1",
            "--decoder-learned-pos",
            "--share-decoder-input-output-embed",
            "--disable-validation",
            *BRANCH_SEMANTICS,
            max_update=6,
        ),
        timeout=240,
    )
    return save_dir / "checkpoint_last.pt"


def eval_lm_in_process(data, path, *extra):
    """fairseq-eval-lm's own ``main`` in this process: {"loss": base-2 loss per token, "perplexity": ...}."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import eval_lm

    from fairseq import options

    args = options.parse_args_and_arch(
        options.get_eval_lm_parser(), [str(data), "--user-dir", USER_DIR, "--path", str(path), "--cpu", *EVAL, *extra]
    )
    results = eval_lm.main(convert_namespace_to_omegaconf(args))
    return {name: float(results[name]) for name in ("loss", "perplexity")}


def model_cfg(data, *flags):
    """cfg["model"] of a ``moe_transformer_lm_tiny`` with ``flags``, as fairseq-train would save it."""
    from omegaconf import OmegaConf

    from fairseq import options
    from support.inputs.tiny_fairseq_models import converted

    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [str(data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "moe_transformer_lm_tiny", *flags],
    )
    return OmegaConf.to_container(converted(args).model, resolve=True)


def as_branch_set(checkpoint, prefix, ranks, **changes):
    state = torch.load(checkpoint, weights_only=False)
    options = branch_lm_options(state["cfg"]["model"], state["cfg"]["model"]["moe_expert_count"], **changes)
    return write_branch_set(prefix, state["model"], options, ranks, task=state["cfg"]["task"])


def printed_scores(output):
    return re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", output).groups()


@pytest.mark.slow
def test_an_imported_moe_lm_set_scores_the_same_loss_and_perplexity_in_fairseq_eval_lm(
    lm_data, trained, tmp_path, capsys
):
    want = eval_lm_in_process(lm_data, trained)
    assert want["perplexity"] < 60, want  # it learned something: 48-token vocabulary
    for ranks in (1, 2):
        prefix = as_branch_set(trained, tmp_path / f"moe_lm_{ranks}" / "model", ranks)
        out = tmp_path / f"imported_{ranks}.pt"
        assert checkpoint_tool(["import-fairseq-moe", str(prefix), str(out)]) == 0
        printed = capsys.readouterr().out
        assert "arch transformer_lm_gpt" in printed and "MoE layers decoder.layers.1" in printed, printed
        assert "encoder" not in printed.split("flags:")[1], printed  # decoder-only: no encoder flags
        imported = torch.load(out, weights_only=False)["cfg"]["model"]
        assert imported["_name"] == "moe_transformer_lm" and imported["decoder_learned_pos"]
        assert imported["share_decoder_input_output_embed"] and imported["decoder_normalize_before"]
        got = eval_lm_in_process(lm_data, out)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=0), ranks
        assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-6, abs=0), ranks
    # The command-line tool itself, once, on the 2-rank-file import: it prints what the original scores.
    output = run_fairseq(
        "eval_lm", lm_data, "--user-dir", USER_DIR, "--path", tmp_path / "imported_2.pt", "--cpu", *EVAL
    )
    assert printed_scores(output) == (f"{want['loss']:.4f}", f"{want['perplexity']:.2f}"), output[-1500:]


@pytest.mark.slow
def test_a_moe_lm_set_imported_for_two_workers_scores_as_the_original_on_two_workers(lm_data, trained, tmp_path):
    from support.launch.multiworker_cli_runs import BIN

    prefix = as_branch_set(trained, tmp_path / "moe_lm" / "model", 2)
    assert checkpoint_tool(["import-fairseq-moe", str(prefix), str(tmp_path / "imported.pt"), "--world-size", "2"]) == 0
    # Each eval-lm worker scores its shard of the batches and fairseq reports rank 0's: the original's score of
    # that shard, in this process, is what rank 0 must print, holding half of the experts.
    want = eval_lm_in_process(lm_data, trained, "--num-shards", "2", "--shard-id", "0")
    log_dir = tmp_path / "logs"
    torchrun(
        2,
        BIN / "fairseq-eval-lm",
        [lm_data, "--user-dir", USER_DIR, "--path", tmp_path / "imported.pt", "--cpu", *EVAL],
        log_dir=log_dir,
        redirects=3,
    )
    rank_0 = "".join(p.read_text() for p in sorted(log_dir.glob("**/0/std*.log")))
    assert "expert-sharded inference: worker 0 of 2 holds experts 0..1" in rank_0, rank_0[-1500:]
    assert printed_scores(rank_0) == (f"{want['loss']:.4f}", f"{want['perplexity']:.2f}"), rank_0[-1500:]


def test_a_decoder_only_branch_model_imports_into_moe_transformer_lm_with_the_same_logits(lm_data, tmp_path):
    """In process, no training: sinusoidal positions, untied embeddings, 8 experts in 4 rank files, MoE in
    every layer."""
    flags = ["--moe-expert-count", "8", "--moe-freq", "1", *BRANCH_SEMANTICS]
    built = language_model(lm_data, *flags)
    model = built.model.eval()
    options = branch_lm_options(model_cfg(lm_data, *flags), 8, arch="transformer_lm", _name="transformer_lm")
    prefix = write_branch_set(tmp_path / "moe_lm" / "model", model.state_dict(), options, 4)
    assert checkpoint_tool(["import-fairseq-moe", str(prefix), str(tmp_path / "imported.pt")]) == 0
    models, _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "imported.pt")], task=built.task)
    imported = models[0].eval()
    decoder = imported.decoder
    assert type(decoder.embed_positions).__name__ == "SinusoidalPositionalEmbedding"
    assert decoder.output_projection.weight is not decoder.embed_tokens.weight  # untied, as the branch's was
    assert torch.equal(decoder.output_projection.weight, model.decoder.output_projection.weight)
    batch = lm_batch(built.task)["net_input"]
    with torch.no_grad():
        assert torch.equal(imported(**batch)[0], model(**batch)[0])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_stable_embedding": True}, "--use-stable-embedding (bitsandbytes' StableEmbedding"),
        (
            {"arch": "transformer_lm_megatron", "_name": "model_parallel_transformer_lm"},
            "is a 'transformer_lm_megatron' language model: import-fairseq-moe imports the branch's transformer_lm",
        ),
        ({"arch": "lightconv_lm", "_name": "lightconv_lm"}, "is a 'lightconv_lm' language model"),
    ],
    ids=["stable-embeddings", "model-parallel-lm", "convolutional-lm"],
)
def test_a_moe_lm_set_this_project_cannot_represent_is_refused_in_one_line(lm_data, tmp_path, capsys, changes, message):
    built = language_model(lm_data, *BRANCH_SEMANTICS)
    options = branch_lm_options(model_cfg(lm_data, *BRANCH_SEMANTICS), 4, **changes)
    prefix = write_branch_set(tmp_path / "moe_lm" / "model", built.model.state_dict(), options, 2)
    assert checkpoint_tool(["import-fairseq-moe", str(prefix), str(tmp_path / "imported.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "(nothing was written)" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "imported.pt").exists()
