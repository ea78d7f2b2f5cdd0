"""A tiny synthetic NLLB-200-MoE-like checkpoint set, for ``recipes/nllb_moe.sh --dry-run``.

Random weights in the released files' layout and option names (the ``nllb`` branch's
``checkpoint_utils.py``, sweep ``examples/nllb/modeling/sweep/sweep_mmt.py`` and README):
``checkpoint_2_300000-shared.pt`` (every parameter but the experts, the routers
``<side>.layers.<i>.moe_layer.gate.wg.weight`` included) and ``checkpoint_2_300000-rank-<r>.pt`` for
twice as many ranks as experts (NLLB-200 MoE: 128 experts on 256 GPUs, so rank r holds expert
r % E and every expert has a replica); ``cfg["model"]`` an argparse Namespace of ``--arch transformer``
with the branch's MoE options as the NLLB-200 MoE run set them (``--moe-eom 0.2``; ``--moe-freq``
2, not 4, in 2 layers; second expert ``all``, fp32 gating, pad mask, eval capacity fraction 1), ``cfg["task"]`` the
multilingual task with ``--add-data-source-prefix-tags``. Also a dictionary.txt, langs.txt and a
tiny bitext (raw text of dictionary symbols) to preprocess. The dense transformer is built by
fairseq itself, so every other key is what fairseq writes; its MoE layers' FFNs become experts.

    python recipes/nllb_tiny_set.py OUT_DIR [--data-bin DIR]
"""

import argparse
import os
import random
import sys

import torch

LANGS = ["eng_Latn", "fra_Latn", "deu_Latn"]
PREFIX = "checkpoint_2_300000"
EXPERTS, RANKS, MOE_FREQ, SYMBOLS = 4, 8, 2, 60
# fmt: off
SHAPE = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--encoder-normalize-before", "--decoder-normalize-before",
         "--share-all-embeddings", "--attention-dropout", "0.1", "--relu-dropout", "0.0", "--dropout", "0.1"]
# fmt: on
# The branch's MoE options, as examples/nllb/modeling/sweep/sweep_mmt.py sets them for NLLB-200 MoE.
# fmt: off
BRANCH_MOE = dict(moe_expert_count=EXPERTS, moe_freq=MOE_FREQ, encoder_moe_freq=MOE_FREQ, decoder_moe_freq=MOE_FREQ,
                  moe_gating_use_fp32=True, moe_second_expert_policy="all",
                  moe_normalize_gate_prob_before_dropping=False, moe_eval_capacity_token_fraction=1.0,
                  use_moe_pad_mask=True, moe_normalize_expert_grad="sqrt_world_size", moe_eom=0.2,
                  moe_gate_loss_wt=0.01, moe_gate_loss_combine_method="sum", moe_batch_prioritized_routing=False,
                  moe_cmr=False, moe_top1_expert=False, moe_local_drop=0.0, replication_count=RANKS // EXPERTS)
# fmt: on


def write_text(out, rng):
    with open(os.path.join(out, "dictionary.txt"), "w") as f:
        f.writelines(f"p{i} {1000 - i}\n" for i in range(SYMBOLS))
    with open(os.path.join(out, "langs.txt"), "w") as f:
        f.writelines(f"{lang}\n" for lang in LANGS)
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
    from fairseq import options, tasks

    import fairseq_moe_ext  # noqa: F401  (registers translation_multi_simple_epoch_nllb)

    for lang in LANGS:  # the multilingual task reads dict.<lang>.txt
        with open(os.path.join(out, "dictionary.txt")) as src, open(os.path.join(out, f"dict.{lang}.txt"), "w") as dst:
            dst.write(src.read())
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            out,
            "--task",
            "translation_multi_simple_epoch_nllb",
            "--arch",
            "transformer",
            "--langs",
            ",".join(LANGS),
            "--lang-pairs",
            "eng_Latn-fra_Latn",
            "--encoder-langtok",
            "src",
            "--decoder-langtok",
            "--add-data-source-prefix-tags",
            "--cpu",
            *SHAPE,
        ],
    )
    task = tasks.setup_task(args)
    for lang in LANGS:
        os.remove(os.path.join(out, f"dict.{lang}.txt"))
    return args, task.build_model(args)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--data-bin", help="also binarize raw/ there (fairseq-preprocess, in this process)")
    parsed = parser.parse_args(argv)
    out = parsed.out
    os.makedirs(out, exist_ok=True)
    rng = random.Random(1)
    torch.manual_seed(1)
    write_text(out, rng)
    args, model = dense_model(out)
    shared, experts = {}, {}
    for key, tensor in model.state_dict().items():
        side, stack, layer, name = (key.split(".", 3) + ["", "", ""])[:4]
        if (
            side in ("encoder", "decoder")
            and stack == "layers"
            and (int(layer) + 1) % MOE_FREQ == 0
            and name.split(".")[0] in ("fc1", "fc2")
        ):
            # E experts in place of the FFN, each its own random draw of that shape and scale
            experts[(f"{side}.layers.{layer}", name)] = [
                torch.randn_like(tensor) * tensor.std() for _ in range(EXPERTS)
            ]
            if name == "fc1.weight":
                shared[f"{side}.layers.{layer}.moe_layer.gate.wg.weight"] = torch.randn(EXPERTS, tensor.shape[1]) * 0.1
        else:
            shared[key] = tensor.clone()
    options = argparse.Namespace(
        **{k: v for k, v in vars(args).items() if not k.startswith("moe_")}, **BRANCH_MOE, _name="transformer"
    )
    task = {
        "_name": "translation_multi_simple_epoch",
        "langs": LANGS,
        "lang_pairs": ["eng_Latn-fra_Latn"],
        "lang_tok_style": "multilingual",
        "encoder_langtok": "src",
        "decoder_langtok": True,
        "add_data_source_prefix_tags": True,
    }
    cfg = {
        "_name": None,
        "common": {"seed": 2},
        "model": options,
        "task": task,
        "criterion": {
            "_name": "moe_label_smoothed_cross_entropy",
            "label_smoothing": 0.1,
            "moe_gate_loss_wt": 0.01,
            "moe_gate_loss_combine_method": "sum",
            "moe_cmr_loss_wt": 0.0,
        },
        "distributed_training": {"distributed_world_size": RANKS},
    }
    head = {
        "cfg": cfg,
        "args": None,
        "extra_state": {"train_iterator": {"epoch": 2}},
        "optimizer_history": [
            {
                "criterion_name": "MoELabelSmoothedCrossEntropyCriterion",
                "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": 2.5},
                "num_updates": 300000,
            }
        ],
    }
    torch.save(
        {"model": shared, "last_optimizer_state": {"state": {}, "param_groups": []}},
        os.path.join(out, f"{PREFIX}-shared.pt"),
    )
    for rank in range(RANKS):
        model_state = {
            f"{layer}.moe_layer.experts.0.{name}": tensors[rank % EXPERTS].clone()
            for (layer, name), tensors in experts.items()
        }
        torch.save({**head, "model": model_state}, os.path.join(out, f"{PREFIX}-rank-{rank}.pt"))
    rows = shared["encoder.embed_tokens.weight"].shape[0]
    print(
        f"wrote {out}/{PREFIX}-shared.pt + {RANKS} rank files ({EXPERTS} experts, replicas), dictionary.txt "
        f"({SYMBOLS} symbols; embedding {rows} rows = 4 + {SYMBOLS} + {len(LANGS)} languages + 3 tags), "
        f"langs.txt, raw/"
    )
    if parsed.data_bin:
        binarize(out, parsed.data_bin)
    return 0


def binarize(out, dest):
    from fairseq import options
    from fairseq_cli import preprocess

    raw = os.path.join(out, "raw")
    dictionary = os.path.join(out, "dictionary.txt")
    preprocess.main(
        options.get_preprocessing_parser().parse_args(
            [
                "-s",
                "eng_Latn",
                "-t",
                "fra_Latn",
                "--trainpref",
                f"{raw}/train",
                "--validpref",
                f"{raw}/valid",
                "--testpref",
                f"{raw}/test",
                "--srcdict",
                dictionary,
                "--tgtdict",
                dictionary,
                "--destdir",
                dest,
                "--workers",
                "1",
            ]
        )
    )
    print(f"binarized raw/ into {dest} with dictionary.txt")


if __name__ == "__main__":
    sys.exit(main())
