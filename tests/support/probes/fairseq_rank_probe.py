"""Run fairseq-train and, on every worker, record what tests need to see per rank.

Usage (under torchrun): python tests/support/probes/fairseq_rank_probe.py OUT_DIR <fairseq-train arguments>
Writes OUT_DIR/rank{R}.pt with the worker's final model state and the gradient norm that worker
computed at every update (fairseq itself logs from rank 0 only).
"""

import logging
import os
import sys

import torch


def main():
    out_dir, argv = sys.argv[1], sys.argv[2:]
    # fairseq-train's own log format, on stdout (an import may already have configured logging).
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=logging.INFO,
        stream=sys.stdout,
        force=True,
    )
    from fairseq_cli import train

    from fairseq import trainer as trainer_module

    seen = {}
    original_clip = trainer_module.Trainer.clip_grad_norm

    def clip_grad_norm(self, clip_norm):
        norm = original_clip(self, clip_norm)
        seen["trainer"] = self
        seen.setdefault("grad_norms", []).append(float(norm))
        return norm

    trainer_module.Trainer.clip_grad_norm = clip_grad_norm
    sys.argv = ["fairseq-train"] + argv
    train.cli_main()
    trainer = seen["trainer"]
    rank = trainer.data_parallel_rank
    state = {k: v.detach().cpu().clone() for k, v in trainer.get_model().state_dict().items()}
    expert = [n for n, p in trainer.get_model().named_parameters() if getattr(p, "expert", False)]
    os.makedirs(out_dir, exist_ok=True)
    torch.save(
        {
            "model": state,
            "expert_keys": expert,
            "grad_norms": seen["grad_norms"],
            "optimizer": optimizer_facts(trainer.optimizer),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def optimizer_facts(optimizer):
    """The optimizer fairseq built: its class, whether fp16 gradients are flattened, how many of its
    (fp32 copies of) parameters keep the expert marker."""
    params = list(optimizer.params)
    return {
        "type": type(optimizer).__name__,
        "flat": bool(getattr(optimizer, "has_flat_params", False)),
        "expert_marked": sum(getattr(p, "expert", False) is True for p in params),
    }


if __name__ == "__main__":
    main()
