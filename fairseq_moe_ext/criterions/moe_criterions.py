"""Criterions that add the MoE layers' balance and z-losses to fairseq's usual objectives.

The layers record their losses in the model's loss cache during forward; the criterion collects
them right after forward, so they reach backward (Tutel users had to recall a process-global cache
in a patched ``train_step``; removing it silently dropped the balance loss).

Loss = inner loss + ``sample_size * (gate_loss_wt * balance + z_loss_wt * z)``: fairseq divides the
gradient by the (global) sample size, so the auxiliary weights do not depend on batch size. Each
worker's balance loss is the group-wide value, scaled by that worker's sample size, which makes the
multi-worker update equal to the single-process one: the gradient of the group-wide statistics is the
sum of every worker's, which the criterion takes once per forward (the workers' sample sizes summed in
backward, ``comm.weight_summed_over_ranks``) where each MoE layer would otherwise sum its own in backward.

``loss`` in the logs stays the inner loss (so ``ppl`` and ``checkpoint_best`` compare with dense
models); the MoE terms are logged beside it.
"""

import contextlib
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.dataclass import FairseqDataclass

from fairseq import metrics

from ..common.refusal import MoEOptionError, MoESetupError
from ..models.moe_config import dataclass_of
from ..moe.comm import weight_summed_over_ranks
from ..options import CRITERION_OPTIONS
from ..options.ranges import CRITERION_RANGES, check_options

# Scalar routing statistics each MoE layer records (MoELayer.route_tokens), summed per layer.
LAYER_STATS = ("num_tokens", "num_slots", "dropped_slots", "router_entropy_sum")


# The criterions' options, one record each (options/criterion.py), as a fairseq dataclass.
MoELossConfig = dataclass_of("MoELossConfig", CRITERION_OPTIONS, FairseqDataclass, module=__name__)


def find_moe_cache(model):
    seen = model
    while seen is not None:
        cache = seen.__dict__.get("moe_cache")
        if cache is not None:
            return cache
        seen = seen.__dict__.get("_modules", {}).get("module")
    return None


def short_layer_name(name: str) -> str:
    """``decoder.layers.3.fc1`` -> ``dec3``: short enough for the progress bar."""
    match = re.search(r"(encoder|decoder)\.layers\.(\d+)", name)
    return f"{match.group(1)[:3]}{match.group(2)}" if match else re.sub(r"\W+", "_", name)


def summed_over(records):
    """The one group over which the records' layers left their losses' gradients to be summed (None: none)."""
    groups = {id(r.aux.collector_sums_over): r.aux.collector_sums_over for r in records}
    groups.pop(id(None), None)
    if len(groups) > 1:
        raise MoESetupError(f"MoE layers of one model total their statistics over {len(groups)} different groups")
    return next(iter(groups.values()), None)


def summing_losses(model):
    """Around the model's forward in a criterion that adds the MoE losses (``add_moe_losses``): the layers leave
    the sum over workers of their losses' gradients to it, one collective per forward in its backward instead of
    one per layer (moe/cache.py); nothing for a model without MoE layers."""
    cache = find_moe_cache(model)
    return cache.summing_collector() if cache is not None else contextlib.nullcontext()


class MoELossMixin:
    needs_moe_model = True  # its balance losses need MoE layers (fairseq_integration/training.check_training_setup)

    def _init_moe_loss(self, moe_gate_loss_wt, moe_z_loss_wt, moe_gate_loss_combine_method, moe_hide_expert_load):
        weights = {"moe_gate_loss_wt": moe_gate_loss_wt, "moe_z_loss_wt": moe_z_loss_wt}
        check_options(CRITERION_RANGES, weights.get)
        self.moe_gate_loss_wt = moe_gate_loss_wt
        self.moe_z_loss_wt = moe_z_loss_wt
        self.moe_combine = str(moe_gate_loss_combine_method)
        self.moe_hide_expert_load = moe_hide_expert_load

    def forward(self, model, sample, reduce=True):
        with summing_losses(model):
            loss, sample_size, logging_output = super().forward(model, sample, reduce)
        loss = self.add_moe_losses(model, loss, sample_size, logging_output, reduce)
        return loss, sample_size, logging_output

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True

    def add_moe_losses(self, model, loss, sample_size, logging_output, reduce=True):
        cache = find_moe_cache(model)
        if cache is None:
            raise MoEOptionError(
                "MoE criterions need an MoE model: use --arch moe_transformer* / moe_transformer_lm*, "
                "or a non-MoE criterion such as cross_entropy"
            )
        records = cache.collect()
        if not records:
            return loss
        applied = cache.router_losses_apply  # False: the router is frozen (--moe-freeze), logged only
        if applied and model.training and torch.is_grad_enabled() and not records[0].aux.balance_loss.requires_grad:
            raise MoESetupError(
                "MoE balance loss has no gradient: the forward ran under no_grad (a reentrant activation "
                "checkpoint?); use --checkpoint-activations of this plugin, which is non-reentrant"
            )
        balance = torch.stack([r.aux.balance_loss for r in records])
        z = torch.stack([r.aux.z_loss for r in records])
        if self.moe_combine == "average":
            balance, z = balance.mean(), z.mean()
        else:
            balance, z = balance.sum(), z.sum()
        aux = weight_summed_over_ranks(
            self.moe_gate_loss_wt * balance + self.moe_z_loss_wt * z, sample_size, summed_over(records)
        )
        if not applied:
            aux = torch.zeros_like(aux.detach())  # what was added: nothing
        elif reduce:
            loss = loss + aux.to(loss.dtype)
        logging_output["moe_show_expert_load"] = 0 if self.moe_hide_expert_load else 1
        # Every number for the logs crosses to the host in one read per forward (the layers keep
        # their statistics on the device): a GPU stalls once here, not per layer and statistic.
        parts = [aux.detach().view(1), balance.detach().view(1), z.detach().view(1)]
        for r in records:
            parts.extend(r.aux.stats[key].detach().reshape(-1) for key in (*LAYER_STATS, "expert_slots"))
        values = iter(torch.cat([p.double() for p in parts]).tolist())
        logging_output["moe_aux_loss"] = next(values)
        logging_output["moe_gate_loss"] = next(values) * sample_size
        logging_output["moe_z_loss"] = next(values) * sample_size
        by_layer = defaultdict(lambda: defaultdict(float))
        for r in records:
            stats = by_layer[short_layer_name(r.layer)]
            for key in LAYER_STATS:
                stats[key] += next(values)
            for e in range(r.aux.stats["expert_slots"].numel()):
                stats[f"e{e}"] += next(values)
        for layer, stats in by_layer.items():
            for key, value in stats.items():
                logging_output[f"moe_stat_{layer}_{key}"] = value
        return loss

    @staticmethod
    def reduce_moe_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        keys = {k for log in logging_outputs for k in log}
        if "moe_gate_loss" not in keys:
            return
        sample_size = total("sample_size")
        for key in ("moe_gate_loss", "moe_z_loss", "moe_aux_loss"):
            metrics.log_scalar(key, total(key) / max(sample_size, 1e-9), sample_size, round=4)
        layers = sorted({m.group(1) for k in keys for m in [re.match(r"moe_stat_(.+)_num_slots$", k)] if m})
        slots = sum(total(f"moe_stat_{layer}_num_slots") for layer in layers)
        tokens = sum(total(f"moe_stat_{layer}_num_tokens") for layer in layers)
        dropped = sum(total(f"moe_stat_{layer}_dropped_slots") for layer in layers)
        entropy = sum(total(f"moe_stat_{layer}_router_entropy_sum") for layer in layers)
        metrics.log_scalar("moe_dropped_frac", dropped / max(slots, 1e-9), slots, round=4)
        metrics.log_scalar("moe_router_entropy", entropy / max(tokens, 1e-9), tokens, round=3)
        worst = 0.0
        for layer in layers:
            layer_slots = total(f"moe_stat_{layer}_num_slots")
            experts = sorted(
                (int(m.group(1)), k) for k in keys for m in [re.match(rf"moe_stat_{layer}_e(\d+)$", k)] if m
            )
            if not experts or layer_slots <= 0:
                continue
            shares = [total(k) / layer_slots for _, k in experts]
            worst = max(worst, max(shares) * len(shares))
            if total("moe_show_expert_load") > 0:
                for (e, _), share in zip(experts, shares):
                    metrics.log_scalar(f"moe_load_{layer}_e{e}", share, layer_slots, round=3, priority=2000)
        metrics.log_scalar("moe_imbalance", worst, 1, round=3)


@dataclass
class MoELabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, MoELossConfig):
    pass


@register_criterion("moe_label_smoothed_cross_entropy", dataclass=MoELabelSmoothedCrossEntropyConfig)
class MoELabelSmoothedCrossEntropyCriterion(MoELossMixin, LabelSmoothedCrossEntropyCriterion):
    def __init__(
        self,
        task,
        sentence_avg,
        label_smoothing,
        ignore_prefix_size=0,
        report_accuracy=False,
        moe_gate_loss_wt=0.01,
        moe_z_loss_wt=0.0,
        moe_gate_loss_combine_method="average",
        moe_hide_expert_load=False,
    ):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self._init_moe_loss(moe_gate_loss_wt, moe_z_loss_wt, moe_gate_loss_combine_method, moe_hide_expert_load)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_moe_metrics(logging_outputs)


@dataclass
class MoECrossEntropyConfig(CrossEntropyCriterionConfig, MoELossConfig):
    pass


@register_criterion("moe_cross_entropy", dataclass=MoECrossEntropyConfig)
class MoECrossEntropyCriterion(MoELossMixin, CrossEntropyCriterion):
    def __init__(
        self,
        task,
        sentence_avg,
        moe_gate_loss_wt=0.01,
        moe_z_loss_wt=0.0,
        moe_gate_loss_combine_method="average",
        moe_hide_expert_load=False,
    ):
        super().__init__(task, sentence_avg)
        self._init_moe_loss(moe_gate_loss_wt, moe_z_loss_wt, moe_gate_loss_combine_method, moe_hide_expert_load)

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        CrossEntropyCriterion.reduce_metrics(logging_outputs)
        MoELossMixin.reduce_moe_metrics(logging_outputs)
