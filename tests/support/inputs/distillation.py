"""Teachers for the distillation tests: a tiny MoE teacher trained one step in this process (the oracle's
flags, on the reversal task's dictionaries) and saved as fairseq saves it, as one file or as a P-file set,
and the flags that make a student of it."""

from pathlib import Path
from typing import List

from fairseq_moe_ext import checkpoint as moe_ckpt
from support.launch.in_process_trainer import build_trainer, collate, sentence_pairs, training_args

TINY_DENSE = [
    "--arch",
    "transformer",
    "--encoder-layers",
    "2",
    "--decoder-layers",
    "2",
    "--encoder-embed-dim",
    "64",
    "--decoder-embed-dim",
    "64",
    "--encoder-ffn-embed-dim",
    "128",
    "--decoder-ffn-embed-dim",
    "128",
    "--encoder-attention-heads",
    "4",
    "--decoder-attention-heads",
    "4",
]


def write_teacher(data_dir: str, path: Path, parallel_size: int = 1, seed: int = 7) -> Path:
    """An MoE teacher (moe_transformer_tiny, 4 experts) after one update on the reversal task, saved at ``path``
    as fairseq's single file, or as a ``parallel_size``-file set under that name; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    task, trainer = build_trainer(training_args(data_dir, 1, ["--seed", str(seed)]))
    trainer.train_step([collate(task, sentence_pairs(10, seed=seed))])
    trainer.consolidate_optimizer()  # what checkpoint_utils.save_checkpoint calls first
    single = path if parallel_size == 1 else path.with_name("whole.pt")
    trainer.save_checkpoint(str(single), {})
    if parallel_size > 1:
        moe_ckpt.save_set(moe_ckpt.load_full(str(single)), str(path.with_suffix("")), parallel_size)
        single.unlink()
    return path


def distilled(argv: List[str], teacher: Path, *flags: str, dense: bool = False) -> List[str]:
    """The oracle's training flags ``argv`` with --criterion moe_distillation from ``teacher`` (and ``flags``);
    ``dense``: the student is a dense transformer of moe_transformer_tiny's shape."""
    argv = list(argv)
    argv[argv.index("--criterion") + 1] = "moe_distillation"
    if dense:
        argv[argv.index("--arch") + 1] = "transformer"
        for flag in ("--moe-expert-count", "--moe-top-k"):
            del argv[argv.index(flag) : argv.index(flag) + 2]
        argv += TINY_DENSE[2:]
    return [*argv, "--distill-teacher", str(teacher), *flags]
