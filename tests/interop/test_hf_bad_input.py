"""Bad input to ``export-hf`` and ``import-hf`` (and a Hugging Face directory given to
``import-fairseq-moe``): one line naming the problem and the fix, exit code 2, nothing written and the
input untouched. A sibling of test_import_fairseq_moe.py's BAD_BRANCH_SETS table: a set NllbMoe cannot
express (each option), and a Hugging Face directory damaged or configured beyond what this project
represents."""

import hashlib
import json
import shutil

import pytest

from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.inputs.branch_sets import branch_model_options, write_branch_set
from support.inputs.hf_sets import EXPERTS, HF_FLAGS, build, joined_data, write_set

# slow, like tests/cli/test_bad_input.py: each case builds a model and writes a set for the tool to refuse,
# about 10 s of CPU for its 41 cases (7 Dec 2026): too much for the fast tier (--fast) run after every edit.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return joined_data(tmp_path_factory.mktemp("joined"))


@pytest.fixture(scope="module")
def good(data, tmp_path_factory):
    """(args, model, an NllbMoe directory exported from it)."""
    args, _, model = build(data, *HF_FLAGS)
    root = tmp_path_factory.mktemp("good")
    assert (
        checkpoint_tool(
            [
                "export-hf",
                str(write_set(args, model, root / "set" / "ck.pt", 2)),
                str(root / "hf"),
                "--max-shard-size",
                "40KB",
            ]
        )
        == 0
    )
    return args, model, root / "hf"


def fingerprint(directory):
    """sha256 of every file under ``directory``; None if it does not exist."""
    if not directory.exists():
        return None
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def flags(drop=(), **set_to):
    """HF_FLAGS without the flags in ``drop`` (and their values), with ``--name value`` for each of ``set_to``."""
    out, skip = [], False
    changed = {"--" + k.replace("_", "-"): v for k, v in set_to.items()}
    for i, flag in enumerate(HF_FLAGS):
        if skip:
            skip = False
            continue
        if flag in drop or flag in changed:
            skip = i + 1 < len(HF_FLAGS) and not HF_FLAGS[i + 1].startswith("--")
            continue
        out.append(flag)
    for flag, value in changed.items():
        out += [flag] if value is True else [flag, str(value)]
    return out


def _edit_args(**changes):
    """Options the parser would not take, as a hand-edited or foreign checkpoint may carry them."""
    return lambda args: [setattr(args, key, value) for key, value in changes.items()]


def _fill(out):
    out.mkdir()
    (out / "README").write_text("someone else's")


# fmt: off
BAD_EXPORTS = [
    # (id, flags to build with, change to its saved options (or None), damage to the output dir (or None), the one
    # line says)
    ("top-k-1", flags(moe_top_k=1), None, None, "--moe-top-k 1: NllbMoe routes every token to exactly 2 experts"),
    ("shared-experts", flags(moe_shared_expert_count=1), None, None, "--moe-shared-expert-count 1: NllbMoe has no"),
    ("balance-bias", flags(moe_balance="bias"), None, None, "--moe-balance bias: NllbMoe has no balance bias"),
    ("cosine-router", flags(moe_router="cosine"), None, None, "--moe-router cosine: NllbMoe's router is a plain"),
    ("gates-not-renormalised", flags(drop=("--moe-normalize-gate",)), None, None,
     "--moe-normalize-gate False: NllbMoe always renormalises the two gates"),
    ("an-activation-nllb-lacks", flags(), _edit_args(activation_fn="relu_squared"), None,
     "--activation-fn relu_squared: NllbMoe has no such activation; export a model with one of relu"),
    ("post-norm-encoder", flags(drop=("--encoder-normalize-before",)), None, None,
     "--encoder-normalize-before False: NllbMoe's encoder layers are pre-norm"),
    ("separate-embeddings", flags(drop=("--share-all-embeddings",)), None, None,
     "--share-all-embeddings False: NllbMoe has one embedding table"),
    ("learned-positions", flags(encoder_learned_pos=True), None, None,
     "--encoder-learned-pos True: NllbMoe's positions are sinusoidal"),
    ("embedding-layer-norm", flags(layernorm_embedding=True), None, None, "--layernorm-embedding True"),
    ("eval-capacity-factor", flags(moe_eval_capacity_factor=1), None, None,
     "--moe-eval-capacity-factor 1.0: NllbMoe's evaluation capacity is ceil(fraction * S)"),
    ("eval-fraction-time-major", flags(moe_eval_capacity_token_fraction=0.25), None, None,
     "--moe-eval-capacity-token-fraction 0.25 without --moe-batch-major-routing: NllbMoe queues tokens"),
    ("random-policy-normalised-before", flags(moe_second_expert_policy="random"), None, None,
     "--moe-second-expert-policy random with gates normalised before dropping: NllbMoe then weights"),
    ("dropless-training", flags(moe_capacity_factor=0), None, None,
     "--moe-capacity-factor 0.0: NllbMoe trains with 2*ceil(S/E) slots per expert (expert_capacity unset), which "
     "is --moe-capacity-factor 1; pass --training-as-nllb"),
    ("gate-noise", flags(moe_gate_noise=1), None, None,
     "--moe-gate-noise 1.0: NllbMoe adds no noise to its router logits; pass --training-as-nllb"),
    ("expert-width-unlike-dense", flags(moe_expert_ffn_dim=64), None, None,
     "--moe-expert-ffn-dim 64: NllbMoe's experts and dense blocks share one encoder_ffn_dim"),
    ("a-language-model", None, None, None, "language model: export-hf writes translation models"),
    ("output-dir-not-empty", flags(), None, _fill, "exists and is not an empty directory; choose a new output"),
]
# fmt: on


@pytest.mark.parametrize(
    "build_flags, damage_set, damage_out, message",
    [row[1:] for row in BAD_EXPORTS],
    ids=[row[0] for row in BAD_EXPORTS],
)
def test_a_set_nllb_moe_cannot_express_is_refused_in_one_line_and_nothing_is_written(
    data, tmp_path, capsys, build_flags, damage_set, damage_out, message
):
    if build_flags is None:
        args, _, model = build(
            data,
            "--moe-normalize-gate",
            "--moe-capacity-factor",
            "1",
            arch="moe_transformer_lm_tiny",
            task="language_modeling",
        )
    else:
        args, _, model = build(data, *build_flags)
    if damage_set:
        damage_set(args)
    name = write_set(args, model, tmp_path / "set" / "ck.pt", 2)
    out = tmp_path / "hf"
    if damage_out:
        damage_out(out)
    before, before_out = fingerprint(tmp_path / "set"), fingerprint(out)
    code = checkpoint_tool(["export-hf", str(name), str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert fingerprint(out) == before_out and fingerprint(tmp_path / "set") == before


DROP = object()  # _config(field=DROP): the field left out


def _config(**changes):
    def damage(d):
        config = json.loads((d / "config.json").read_text())
        config.update(changes)
        config = {k: v for k, v in config.items() if v is not DROP}
        (d / "config.json").write_text(json.dumps(config))

    return damage


def _shard(n):
    return lambda d: sorted(d.glob("model-*.safetensors"))[n]


def _remove_shard(n):
    return lambda d: _shard(n)(d).unlink()


def _truncate_shard(n):
    return lambda d: _shard(n)(d).write_bytes(_shard(n)(d).read_bytes()[:-100])


def _index(edit):
    def damage(d):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        edit(index["weight_map"], sorted(set(index["weight_map"].values())))
        (d / "model.safetensors.index.json").write_text(json.dumps(index))

    return damage


def _name_a_missing_file(weight_map, files):
    weight_map["model.shared.weight"] = "model-00099-of-00099.safetensors"


def _misplace_a_tensor(weight_map, files):
    weight_map["model.shared.weight"] = next(f for f in files if f != weight_map["model.shared.weight"])


def _branch_set_beside(d):
    d.parent.joinpath("branch").mkdir()
    args, model = _branch_set_beside.source
    write_branch_set(d.parent / "branch" / "ck", model.state_dict(), branch_model_options(args, EXPERTS), 2)


def _existing_output(d):
    (d.parent / "out" / "imported.pt").write_bytes(b"an earlier import")


# fmt: off
BAD_IMPORTS = [
    # (id, tool, damage to the copied HF dir, what is passed instead of it (or None), the one line says)
    ("not-nllb-moe", "import-hf", _config(model_type="t5"), None, "has model_type 't5': import-hf reads"),
    ("unknown-second-expert-policy", "import-hf", _config(second_expert_policy="top3"), None,
     "second_expert_policy is 'top3', which NllbMoe's router does not define"),
    ("random-policy-normalised-before", "import-hf",
     _config(second_expert_policy="random", normalize_router_prob_before_dropping=True), None,
     "second_expert_policy 'random' with normalize_router_prob_before_dropping true weights the second expert"),
    ("router-bias", "import-hf", _config(router_bias=True), None, "router_bias is True (a bias on the router)"),
    ("no-eval-fraction-fixed-capacity", "import-hf", _config(moe_eval_capacity_token_fraction=0, expert_capacity=8),
     None, "moe_eval_capacity_token_fraction is 0 with expert_capacity 8: NllbMoe then evaluates with a fixed 8"),
    ("untied-output-projection", "import-hf", _config(tie_word_embeddings=False), None,
     "tie_word_embeddings is False (a separate output projection)"),
    ("another-vocabulary-order", "import-hf", _config(pad_token_id=0), None,
     "pad_token_id is 0 (fairseq's dictionary has <s> 0, <pad> 1"),
    ("missing-shard", "import-hf", _remove_shard(1), None, "names model-00002-of-0000"),
    ("index-names-a-missing-file", "import-hf", _index(_name_a_missing_file), None,
     "names model-00099-of-00099.safetensors, which is missing"),
    ("index-misplaces-a-tensor", "import-hf", _index(_misplace_a_tensor), None,
     "places model.shared.weight in model-0000"),
    ("shapes-disagree-with-config", "import-hf", _config(encoder_ffn_dim=40), None,
     "has shape [48, 32], but config.json implies [40, 32]"),
    ("sparse-where-config-says-dense", "import-hf", _config(encoder_sparse_step=1), None,
     "lacks the tensor for encoder.layers.0.fc1.router.wg.weight that config.json implies"),
    ("truncated-safetensors", "import-hf", _truncate_shard(0), None, "is not a complete safetensors file"),
    ("no-config", "import-hf", lambda d: (d / "config.json").unlink(), None, "has no config.json"),
    ("a-branch-set-given-to-import-hf", "import-hf", _branch_set_beside, "branch/ck",
     "names a fairseq moe/nllb-branch set (ck-shared.pt): use import-fairseq-moe"),
    ("an-hf-dir-given-to-import-fairseq-moe", "import-fairseq-moe", None, None,
     "a Hugging Face checkpoint; use import-hf"),
    ("existing-output", "import-hf", _existing_output, None, "imported.pt exists; choose another output name"),
    # a config.json missing a field, or holding a non-number: one line naming the file and the field
    ("config-without-d-model", "import-hf", _config(d_model=DROP), None, "config.json has no d_model: NllbMoe's"),
    ("config-with-a-string-expert-count", "import-hf", _config(num_experts="8"), None,
     "config.json: num_experts is '8', not an integer: write it as one in config.json"),
    ("config-with-fractional-layers", "import-hf", _config(encoder_layers=2.5), None,
     "config.json: encoder_layers is 2.5, not an integer"),
    ("config-with-a-string-dropout", "import-hf", _config(dropout="0.1"), None, "config.json: dropout is '0.1', not a"),
    ("config-with-no-experts", "import-hf", _config(num_experts=0), None,
     "config.json: num_experts is 0, outside its range: write an integer from 1 to 1048576 in config.json"),
    ("config-with-a-dropout-above-one", "import-hf", _config(dropout=1.5), None,
     "config.json: dropout is 1.5, outside its range: write a number from 0 to 1 in config.json"),
]
# fmt: on


@pytest.mark.parametrize(
    "tool, damage, given, message", [row[1:] for row in BAD_IMPORTS], ids=[row[0] for row in BAD_IMPORTS]
)
def test_a_bad_hugging_face_directory_is_refused_in_one_line_and_nothing_is_written(
    good, tmp_path, capsys, tool, damage, given, message
):
    args, model, hf_dir = good
    source = tmp_path / "hf"
    shutil.copytree(hf_dir, source)
    (tmp_path / "out").mkdir()
    _branch_set_beside.source = (args, model)
    if damage is not None:
        damage(source)
    before, before_out = fingerprint(tmp_path), fingerprint(tmp_path / "out")
    code = checkpoint_tool(
        [tool, str(tmp_path / given if given else source), str(tmp_path / "out" / "imported.pt"), "--world-size", "2"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert fingerprint(tmp_path / "out") == before_out and fingerprint(tmp_path) == before


@pytest.mark.parametrize("command", ["export-hf", "import-hf"])
def test_a_disk_filling_up_mid_write_leaves_nothing_behind_and_says_so_in_one_line(
    good, tmp_path, capsys, monkeypatch, command
):
    """The second file written fails with ENOSPC (export: a shard; import: an output rank file)."""
    import errno

    from fairseq_moe_ext.checkpoint.hf import exporter as hf_export
    from fairseq_moe_ext.checkpoint.hf import importer as hf_import

    args, model, hf_dir = good
    module, name = (hf_export, "write_safetensors") if command == "export-hf" else (hf_import.torch, "save")
    real, calls = getattr(module, name), []

    def full_disk(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    source = write_set(args, model, tmp_path / "set" / "ck.pt", 2) if command == "export-hf" else hf_dir
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / ("hf" if command == "export-hf" else "imported.pt")
    monkeypatch.setattr(module, name, full_disk)
    code = checkpoint_tool(
        [
            command,
            str(source),
            str(target),
            *(["--max-shard-size", "40KB"] if command == "export-hf" else ["--world-size", "2"]),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert (
        code == 2 and len(err.splitlines()) == 1 and "no space left on device" in err and "nothing was written" in err
    ), err
    assert len(calls) == 2 and list((tmp_path / "out").iterdir()) == []  # no file, no directory


ACCEPTED_IMPORTS = [
    # (id, change to config.json, the imported option and its value): refused before the nllb routing options landed
    ("second-expert-sampling", _config(second_expert_policy="sampling"), "moe_second_expert_policy", "sampling"),
    ("eval-capacity-fraction", _config(moe_eval_capacity_token_fraction=0.5), "moe_eval_capacity_token_fraction", 0.5),
    (
        "normalised-after-dropping",
        _config(normalize_router_prob_before_dropping=False),
        "moe_normalize_gate_after_dropping",
        True,
    ),
    ("no-eval-fraction-capacity-unset", _config(moe_eval_capacity_token_fraction=0), "moe_eval_capacity_factor", 1.0),
]


@pytest.mark.parametrize(
    "damage, option, value", [row[1:] for row in ACCEPTED_IMPORTS], ids=[row[0] for row in ACCEPTED_IMPORTS]
)
def test_an_hf_config_with_the_nllb_routing_options_imports_with_the_matching_flag(
    good, tmp_path, damage, option, value
):
    from fairseq_moe_ext import checkpoint as moe_ckpt

    _, _, hf_dir = good
    shutil.copytree(hf_dir, tmp_path / "hf")
    damage(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    assert checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out" / "ck.pt")]) == 0
    args = moe_ckpt.load_full(str(tmp_path / "out" / "ck.pt"))["args"]
    assert getattr(args, option) == value and args.moe_batch_major_routing
