"""The steps of the combination matrix (tests/parallel/test_combination_matrix.py): each cell's update on its
W gloo workers through fairseq's Trainer, one launch for every cell of a world size, and one process's update
on the whole batch, shared by the cells it is the reference of.

Every cell steps with NAG (a momentum buffer per parameter, and a first update proportional to the
gradient, so a wrong gradient scale shows) on the same micro-batches: 12 sentence pairs each, cut into the
workers' shares. What is compared are the fp32 weights the optimizer steps (``master_weights``), before and
after, the logged loss and gradient norm, and the buffers (the balance biases). A refusal is recorded as its
line; anything else that goes wrong, as its traceback.

Expert Output Masking draws its masks from each worker's random stream, which no layout can make one
process's: in the matrix its draw is replaced by a mask keyed on each row's largest output (the rows one
process and W workers mask are then the same), so what is checked is everything around the draw.
"""

import os
import traceback

import torch

from support.launch.in_process_trainer import build_trainer, collate, micro_batches, training_args
from support.launch.mixed_precision_steps import NAG, master_weights

SHARES = {1: [12], 2: [5, 7], 4: [2, 5, 3, 2]}


def keyed_mask(expert_out, p, training):
    """EOM with the random draw replaced: in training, a row whose largest output sits at an index divisible
    by 5 is masked (a fifth of the rows, as p = 0.2 masks); evaluation as EOM."""
    if p == 0.0:
        return expert_out
    if not training:
        return expert_out * (1.0 - p)
    keep = expert_out.detach().float().argmax(dim=1) % 5 != 0
    return expert_out * keep.unsqueeze(1).to(expert_out.dtype)


def dense_checkpoint(data_dir, path):
    """A dense ``transformer`` of moe_transformer_tiny's shape on the matrix's dictionaries, saved by fairseq's
    Trainer at update 0: what ``--moe-upcycle-from`` starts the upcycled cells from."""
    from support.launch.fairseq_helpers import translation_flags

    # fmt: off
    shape = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
             "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
             "--criterion", "label_smoothed_cross_entropy", "--optimizer", "nag", "--lr", "0.1", "--cpu",
             "--seed", "5", "--dropout", "0", "--save-dir", os.path.dirname(path)]
    # fmt: on
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _, trainer = build_trainer([*translation_flags(data_dir, "transformer"), *shape])
    trainer.consolidate_optimizer()  # what fairseq's save_checkpoint calls first
    trainer.save_checkpoint(path, {})
    return path


def cell_step(data_dir, cell, rank, root, dense):
    """This worker's update in ``cell`` (one process: rank 0 of 1)."""
    from fairseq.logging import metrics

    from fairseq_moe_ext.moe import layer as moe_layer

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    save_dir = os.path.join(root, f"{cell.id}-W{world}")
    argv = training_args(data_dir, world, [*cell.flags(dense, world == 1), *NAG, "--save-dir", save_dir])
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # fairseq's logged zero norm after an fp16 overflow
    masking = moe_layer.mask_expert_outputs
    moe_layer.mask_expert_outputs = keyed_mask
    try:
        task, trainer = build_trainer(argv)
        if cell.has("upcycle_from=dense"):
            trainer.load_checkpoint(os.path.join(save_dir, "checkpoint_last.pt"))  # no set there: upcycled
        shares = SHARES[world]
        start = sum(shares[:rank])
        batches = [b[start : start + shares[rank]] for b in micro_batches(SHARES[1], cell.update_freq)]
        result = {"before": master_weights(trainer)}
        with metrics.aggregate(new_root=True) as agg:
            trainer.train_step([collate(task, pairs) for pairs in batches])
        model = trainer.get_model()
        result.update(loss=float(agg["loss"].avg), gnorm=float(agg["gnorm"].avg), after=master_weights(trainer))
        result["buffers"] = {n: b.detach().clone() for n, b in model.named_buffers()}
        result["expert_names"] = [n for n, p in model.named_parameters() if getattr(p, "expert", False)]
        return result
    finally:
        moe_layer.mask_expert_outputs = masking


def outcome(step, *args):
    """``step(*args)``, or the line of the refusal it raised, or the traceback of anything else."""
    from fairseq_moe_ext.common.refusal import MoERefusal

    try:
        return step(*args)
    except MoERefusal as refused:
        return {"refused": str(refused)}
    except Exception:  # noqa: BLE001 - recorded for the cell's own test to report
        return {"error": traceback.format_exc()}


def cells_worker(rank, world, data_dir, cells, root, dense):
    """Every cell of this world size, in turn, on the same workers: {cell id: this worker's outcome}."""
    return {cell.id: outcome(cell_step, data_dir, cell, rank, root, dense) for cell in cells}
