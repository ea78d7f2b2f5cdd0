"""A tiny NLLB-200 MoE release lookalike, for ``recipes/nllb_moe.sh --dry-run`` and the tests.

Random weights, shaped as the released files are in every respect the import meets (read on
fairseq's ``nllb`` branch: ``trainer.py``'s ``state_dict``, ``moe_checkpoint_utils.py``'s
``split_shared_and_expert_states``, ``optim/fused_adam.py``, the sweep ``examples/nllb/modeling/
sweep/sweep_mmt.py`` and ``train/train_script.py``, ``scripts/flores200/langs.txt``):

- ``checkpoint_2_300000-rank-<r>.pt`` for 2E ranks (the release: 128 experts on 256 GPUs), rank r
  holding expert ``r % E`` under local number 0, the replicas bit-identical copies; the cfg records
  2E workers. ``--first-experts-only`` writes ranks 0..E-1 only (what transformers' converter and
  pasero read, and what a user who kept half of the download has).
- ``checkpoint_2_300000-shared.pt``: every other parameter, the routers included, and the
  encoder/decoder embeddings and output projection as three separate copies (as the released shared
  file holds them; pasero ties them again); the same head (cfg, history, extra state) as a rank file.
- every tensor fp16 (``--memory-efficient-fp16``: the trainer saves parameters without casting).
- ``last_optimizer_state`` in every file, as ``split_shared_and_expert_states`` splits the
  memory-efficient fp16 optimizer's state: ``param_groups`` and ``loss_scale`` in both, ``state``
  {parameter index: step, fp16 ``exp_avg``/``exp_avg_sq`` and their scales (``--fp16-adam-stats``)}.
- ``cfg["model"]`` a Namespace with every option of the final training command (moe-freq 4, eom
  0.2, second expert ``all``, fp32 gating, eval capacity token fraction 1.0, pad mask,
  ``sqrt_world_size``, shared embeddings, pre-norm, scaled embeddings); ``cfg["task"]`` the
  multilingual task with the data-source tags, an argparse Namespace too (a legacy task, as the branch's
  ``translation_multi_simple_epoch`` was: fairseq stores such a task's options as a Namespace);
  ``cfg["criterion"]`` the MoE criterion's options, the gate losses combined by ``sum``.
- laid out as the downloads unpack: the checkpoint files in ``OUT_DIR/model_moe_54b/`` (the model tarball's
  directory), ``dictionary.txt`` (symbols only: the embedding is 4 specials + symbols + languages + 3 tags) and
  ``langs.txt`` as ONE comma-separated line, as NLLB's, in ``OUT_DIR`` (downloads of their own).

    python recipes/nllb_tiny_set.py OUT_DIR [--data-bin DIR] [--first-experts-only]
"""

import argparse
import os
import random
import sys

import numpy
import torch

LANGS = ["eng_Latn", "fra_Latn", "deu_Latn"]
PREFIX = "checkpoint_2_300000"
TARBALL_DIR = "model_moe_54b"  # the directory the release's model tarball unpacks into
EXPERTS, MOE_FREQ, SYMBOLS, LAYERS, UPDATES = 4, 4, 60, 4, 300000
RANKS = 2 * EXPERTS
# fmt: off
SHAPE = ["--encoder-layers", str(LAYERS), "--decoder-layers", str(LAYERS), "--encoder-embed-dim", "32",
         "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
         "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--encoder-normalize-before",
         "--decoder-normalize-before", "--share-all-embeddings", "--attention-dropout", "0.1", "--relu-dropout", "0.0",
         "--dropout", "0.3", "--max-source-positions", "512", "--max-target-positions", "512"]
# The branch's MoE options as sweep_mmt.py sets them for NLLB-200 MoE (--moe-freq 4 --moe-eom 0.2, the README).
BRANCH_MOE = dict(moe_expert_count=EXPERTS, moe_freq=MOE_FREQ, encoder_moe_freq=MOE_FREQ, decoder_moe_freq=MOE_FREQ,
                  moe_gating_use_fp32=True, moe_second_expert_policy="all",
                  moe_normalize_gate_prob_before_dropping=False, moe_eval_capacity_token_fraction=1.0,
                  use_moe_pad_mask=True, moe_normalize_expert_grad="sqrt_world_size", moe_eom=0.2,
                  moe_gate_loss_wt=0.01, moe_gate_loss_combine_method="sum", moe_batch_prioritized_routing=False,
                  moe_cmr=False, moe_top1_expert=False, moe_local_drop=0.0, moe_fom=0.0, replication_count=1,
                  no_scale_embedding=False, memory_efficient_fp16=True, fp16_adam_stats=True, share_all_embeddings=True)
# fmt: on


def write_text(out, rng):
    with open(os.path.join(out, "dictionary.txt"), "w") as f:
        f.writelines(f"p{i} {1000 - i}\n" for i in range(SYMBOLS))
    with open(os.path.join(out, "langs.txt"), "w") as f:
        f.write(",".join(LANGS) + "\n")  # NLLB's langs.txt: one line of comma-separated codes
    raw = os.path.join(out, "raw")
    os.makedirs(raw, exist_ok=True)
    for split, lines in (("train", 64), ("valid", 8), ("test", 8)):
        pairs = [[f"p{rng.randrange(SYMBOLS)}" for _ in range(rng.randrange(3, 9))] for _ in range(lines)]
        for lang, side in (("eng_Latn", 0), ("fra_Latn", 1)):
            with open(os.path.join(raw, f"{split}.{lang}"), "w") as f:
                # the "translation" reverses the sentence: a model can learn it in a few updates
                f.writelines(" ".join(p if side == 0 else p[::-1]) + "\n" for p in pairs)


def dense_model(out):
    """fairseq's own dense transformer on the NLLB task's dictionary (symbols, languages, 3 tags)."""
    import fairseq_moe_ext  # noqa: F401  (registers translation_multi_simple_epoch_nllb)
    from fairseq import options, tasks

    for lang in LANGS:  # the multilingual task reads dict.<lang>.txt
        with open(os.path.join(out, "dictionary.txt")) as src, open(os.path.join(out, f"dict.{lang}.txt"), "w") as dst:
            dst.write(src.read())
    # fmt: off
    args = options.parse_args_and_arch(options.get_training_parser(), [
        out, "--task", "translation_multi_simple_epoch_nllb", "--arch", "transformer", "--langs", ",".join(LANGS),
        "--lang-pairs", "eng_Latn-fra_Latn", "--encoder-langtok", "src", "--decoder-langtok",
        "--add-data-source-prefix-tags", "--cpu", *SHAPE])
    # fmt: on
    task = tasks.setup_task(args)
    for lang in LANGS:
        os.remove(os.path.join(out, f"dict.{lang}.txt"))
    return args, task.build_model(args)


def split_model(model):
    """(shared state, {(layer, tensor name): [E tensors]}) in fp16, the MoE layers' FFNs made experts."""
    shared, experts = {}, {}
    for key, tensor in model.state_dict().items():
        side, stack, layer, name = (key.split(".", 3) + ["", "", ""])[:4]
        if stack == "layers" and (int(layer) + 1) % MOE_FREQ == 0 and name.split(".")[0] in ("fc1", "fc2"):
            # E experts in place of the FFN, each its own random draw of that shape and scale
            draws = [torch.randn_like(tensor) * tensor.std() for _ in range(EXPERTS)]
            experts[(f"{side}.layers.{layer}", name)] = [t.half() for t in draws]
            if name == "fc1.weight":
                router = torch.randn(EXPERTS, tensor.shape[1]) * 0.1
                shared[f"{side}.layers.{layer}.moe_layer.gate.wg.weight"] = router.half()
        else:
            shared[key] = tensor.detach().clone().half()  # a copy each: tied embeddings are 3 tensors here
    return shared, experts


def optimizer_state(names, indices, param_groups):
    """``last_optimizer_state`` of one file: fairseq's FusedAdam state with --fp16-adam-stats, for ``names``."""
    state = {}
    for name, tensor in names.items():
        state[indices[name]] = {
            "step": UPDATES,
            "exp_avg": (torch.randn_like(tensor.float()) * 1e-3).half(),
            "exp_avg_sq": (torch.rand_like(tensor.float()) * 1e-4).half(),
            "exp_avg_scale": 1.0,
            "exp_avg_sq_scale": 1.0,
        }
    return {"param_groups": param_groups, "loss_scale": 8.0, "state": state}


def release_cfg(args):
    options = argparse.Namespace(
        **{k: v for k, v in vars(args).items() if not k.startswith("moe_") and k not in BRANCH_MOE},
        **BRANCH_MOE,
        _name="transformer",
    )
    # fmt: off
    task = argparse.Namespace(_name="translation_multi_simple_epoch", task="translation_multi_simple_epoch",
                              langs=list(LANGS), lang_dict=None, lang_pairs=["eng_Latn-fra_Latn"],
                              lang_tok_style="multilingual", encoder_langtok="src", decoder_langtok=True,
                              add_data_source_prefix_tags=True, sampling_method="temperature",
                              sampling_temperature=1.0, enable_m2m_validation=True,
                              train_subset="train,train_mining,train_mmt_bt,train_smt_bt")
    return {"_name": None, "common": {"seed": 2, "fp16": True, "memory_efficient_fp16": True},
            "model": options, "task": task,
            "criterion": {"_name": "moe_label_smoothed_cross_entropy", "label_smoothing": 0.1,
                          "moe_gate_loss_wt": 0.01, "moe_gate_loss_combine_method": "sum", "moe_cmr_loss_wt": 0.0},
            "optimizer": {"_name": "adam", "adam_betas": "(0.9, 0.98)", "adam_eps": 1e-06, "weight_decay": 0.0,
                          "fp16_adam_stats": True},
            "lr_scheduler": {"_name": "inverse_sqrt", "warmup_updates": 8000, "warmup_init_lr": 1e-07},
            "optimization": {"lr": [0.002], "max_update": UPDATES, "clip_norm": 0.0, "update_freq": [1]},
            "dataset": {"max_tokens": 4096, "train_subset": "train,train_mining,train_mmt_bt,train_smt_bt",
                        "skip_invalid_size_inputs_valid_test": True},
            "checkpoint": {"save_interval_updates": 10000, "best_checkpoint_metric": "nll_loss"},
            "distributed_training": {"distributed_world_size": RANKS, "ddp_backend": "fully_sharded"}}
    # fmt: on


def head(cfg):
    """What the branch's trainer writes in every file besides model and optimizer state."""
    meters = {"train": {"loss": {"val": numpy.float64(2.5), "sum": 25.0, "count": 10, "round": 3}}}
    return {
        "args": None,
        "cfg": cfg,
        "criterion": None,
        "optimizer_history": [
            {
                "criterion_name": "MoELabelSmoothedCrossEntropyCriterion",
                "optimizer_name": "MemoryEfficientFP16Optimizer",
                "lr_scheduler_state": {"best": 2.5},
                "num_updates": UPDATES,
            }
        ],
        "task_state": {},
        "extra_state": {"metrics": meters, "previous_training_time": 1.0e6, "train_iterator": {"epoch": 2}},
    }


def write_release_set(out, first_experts_only=False, seed=1):
    """Write the lookalike into ``out``; returns the prefix of its checkpoint files."""
    os.makedirs(out, exist_ok=True)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    write_text(out, rng)
    args, model = dense_model(out)
    shared, experts = split_model(model)
    expert_names = [f"{layer}.moe_layer.experts.0.{name}" for layer, name in experts]
    indices = {name: i for i, name in enumerate([*shared, *expert_names])}
    param_groups = [{"lr": [0.002], "betas": (0.9, 0.98), "eps": 1e-06, "params": list(range(len(indices)))}]
    cfg = release_cfg(args)
    os.makedirs(os.path.join(out, TARBALL_DIR), exist_ok=True)
    prefix = os.path.join(out, TARBALL_DIR, PREFIX)
    optimizer = optimizer_state(shared, indices, param_groups)
    torch.save({**head(cfg), "model": shared, "last_optimizer_state": optimizer}, f"{prefix}-shared.pt")
    moments = {}  # a replica's Adam moments are the same numbers too: drawn once per expert
    for rank in range(EXPERTS if first_experts_only else RANKS):
        model_state = {
            f"{layer}.moe_layer.experts.0.{name}": tensors[rank % EXPERTS].clone()
            for (layer, name), tensors in experts.items()
        }
        if rank % EXPERTS not in moments:
            moments[rank % EXPERTS] = optimizer_state(model_state, indices, param_groups)
        state = {**head(cfg), "model": model_state, "last_optimizer_state": moments[rank % EXPERTS]}
        torch.save(state, f"{prefix}-rank-{rank}.pt")
    return prefix


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--data-bin", help="also binarize raw/ there (fairseq-preprocess, in this process)")
    parser.add_argument("--first-experts-only", action="store_true", help=f"write ranks 0..{EXPERTS - 1} only")
    parsed = parser.parse_args(argv)
    prefix = write_release_set(parsed.out, parsed.first_experts_only)
    ranks = EXPERTS if parsed.first_experts_only else RANKS
    rows = 4 + SYMBOLS + len(LANGS) + 3
    print(
        f"wrote {prefix}-shared.pt + {ranks} rank files ({EXPERTS} experts, "
        f"{'the first E of a 2E-worker run' if parsed.first_experts_only else 'with replicas'}; fp16, with optimizer "
        f"state), dictionary.txt ({SYMBOLS} symbols; embedding {rows} rows = 4 + {SYMBOLS} + {len(LANGS)} languages "
        f"+ 3 tags), langs.txt (one comma line), raw/"
    )
    if parsed.data_bin:
        binarize(parsed.out, parsed.data_bin)
    return 0


def binarize(out, dest):
    from fairseq_cli import preprocess

    from fairseq import options

    raw = os.path.join(out, "raw")
    dictionary = os.path.join(out, "dictionary.txt")
    # fmt: off
    preprocess.main(options.get_preprocessing_parser().parse_args([
        "-s", "eng_Latn", "-t", "fra_Latn", "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid",
        "--testpref", f"{raw}/test", "--srcdict", dictionary, "--tgtdict", dictionary, "--destdir", dest,
        "--workers", "1"]))
    # fmt: on
    print(f"binarized raw/ into {dest} with dictionary.txt")


if __name__ == "__main__":
    sys.exit(main())
