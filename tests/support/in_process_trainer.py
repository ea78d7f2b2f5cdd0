"""fairseq's own Trainer in this process (or in each gloo worker): dictionaries, a tiny reversal
task's sentence pairs, the training flags of the expert-parallel oracle, a Trainer built the way
fairseq-train builds one, and a batch collated from pairs. Used by the oracles of tests/fairseq/.
"""

import os

import torch
import torch.distributed as dist

import fairseq_moe_ext

VOCAB = [f"w{i}" for i in range(30)]


def write_dictionaries(data_dir):
    os.makedirs(data_dir, exist_ok=True)
    for lang in ("src", "tgt"):
        with open(os.path.join(data_dir, f"dict.{lang}.txt"), "w") as f:
            f.writelines(f"{w} 1\n" for w in VOCAB)


def sentence_pairs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        length = int(torch.randint(2, 9, (1,), generator=g))
        src = torch.randint(len(VOCAB), (length,), generator=g)
        pairs.append((src, src.flip(0)))
    return pairs


def training_args(data_dir, world_size, extra=()):
    return [
        data_dir, "--user-dir", fairseq_moe_ext.PACKAGE_DIR, "--task", "translation",
        "--source-lang", "src", "--target-lang", "tgt",
        "--arch", "moe_transformer_tiny", "--moe-expert-count", "4", "--moe-top-k", "2",
        "--dropout", "0", "--attention-dropout", "0",
        "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--moe-gate-loss-wt", "0.5", "--moe-z-loss-wt", "0.05",
        "--optimizer", "sgd", "--momentum", "0", "--lr", "0.5", "--clip-norm", "0.7",
        "--cpu", "--seed", "3", "--distributed-world-size", str(world_size),
        "--distributed-backend", "gloo", *extra,
    ]


def build_trainer(argv):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)
    if dist.is_initialized():
        cfg.distributed_training.distributed_rank = dist.get_rank()
    torch.manual_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return task, Trainer(cfg, task, model, criterion)


def collate(task, pairs):
    from fairseq.data import LanguagePairDataset

    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    to_ids = lambda d, t: torch.cat([t + d.nspecial, torch.tensor([d.eos()])])
    src = [to_ids(src_dict, s) for s, _ in pairs]
    tgt = [to_ids(tgt_dict, t) for _, t in pairs]
    dataset = LanguagePairDataset(src, [len(s) for s in src], src_dict, tgt, [len(t) for t in tgt], tgt_dict)
    return dataset.collater([dataset[i] for i in range(len(pairs))])
