"""``--criterion moe_distillation``: word-level knowledge distillation (Hinton et al. 2015; Kim and Rush 2016,
"Sequence-Level Knowledge Distillation", word-level KD) from a teacher checkpoint into a student, on top of
``moe_label_smoothed_cross_entropy``. The student may be dense (``--arch transformer``), an MoE, or a pruned
set of the teacher; the teacher any checkpoint this plugin loads (``teacher.py``).

Per target token t (pads and ``--ignore-prefix-size`` positions left out), with the student's logits z_t and
the teacher's u_t, at temperature T and mix weight w:

    q_t  = softmax(u_t / T)                       with --distill-top-k K: over the teacher's K largest logits,
                                                  renormalised (the other tokens' q is 0)
    KL_t = sum_v q_t,v (log q_t,v - log_softmax(z_t / T)_v)       (log_softmax over the whole vocabulary)

    loss = (1 - w) * sum_t label_smoothed_nll(z_t) + w * T^2 * sum_t KL_t   [+ an MoE student's balance losses]

The T^2 keeps the teacher's term as strong as the labels' across temperatures: its gradient with respect to
z_t is w * T * (softmax(z_t / T) - q_t). ``loss`` in the logs is that mix; ``nll_loss`` (and ``ppl``) the
student's own cross-entropy against the labels, as for every criterion, and ``distill_kl`` the mean KL_t
(base 2, as fairseq logs losses).

The teacher runs first on each batch, in eval mode under ``torch.no_grad``, on every worker and for fairseq's
dummy batches too, so a teacher whose experts are spread over the workers meets them in every MoE call (the
same number of calls on every worker: lock-step without a lock-step). Its MoE layers record their balance
losses in its own cache, emptied after each forward: they never reach the student's loss. It is kept outside
the criterion's module tree (``object.__setattr__``), so the Trainer never saves it, never gives it to the
optimizer or to a data-parallel or FSDP wrapper, and never casts it; it moves to the batch's device at its
first forward.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fairseq.criterions import register_criterion
from fairseq.dataclass import FairseqDataclass
from omegaconf import II

from fairseq import metrics

from ..common.refusal import MoEOptionError
from ..models.moe_config import dataclass_of
from ..options.criterion import DISTILL_OPTIONS
from ..options.ranges import DISTILL_RANGES, check_options
from . import teacher as teachers
from .moe_criterions import (
    MoELabelSmoothedCrossEntropyConfig,
    MoELabelSmoothedCrossEntropyCriterion,
    find_moe_cache,
    summing_losses,
)

# The distillation options, one record each (options/criterion.py), as a fairseq dataclass.
DistillationOptions = dataclass_of("DistillationOptions", DISTILL_OPTIONS, FairseqDataclass, module=__name__)


@dataclass
class MoEDistillationConfig(MoELabelSmoothedCrossEntropyConfig, DistillationOptions):
    # The run's precision (fairseq's own flags, read as sentence_avg is): the teacher's dtype "student".
    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")
    memory_efficient_fp16: bool = II("common.memory_efficient_fp16")
    memory_efficient_bf16: bool = II("common.memory_efficient_bf16")


def kl_per_token(student_logits, teacher_log_probs, teacher_index, temperature: float):
    """KL_t of the module docstring for rows of logits (fp32): ``teacher_log_probs`` log q over the whole
    vocabulary, or over the K tokens ``teacher_index`` names."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    if teacher_index is not None:
        student = student.gather(-1, teacher_index)
    return (teacher_log_probs.exp() * (teacher_log_probs - student)).sum(-1)


@register_criterion("moe_distillation", dataclass=MoEDistillationConfig)
class MoEDistillationCriterion(MoELabelSmoothedCrossEntropyCriterion):
    needs_moe_model = False  # a dense student has no balance losses to add

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
        distill_teacher=None,
        distill_weight=0.5,
        distill_temperature=1.0,
        distill_top_k=0,
        distill_teacher_dtype="student",
        distill_teacher_experts="auto",
        fp16=False,
        bf16=False,
        memory_efficient_fp16=False,
        memory_efficient_bf16=False,
    ):
        super().__init__(
            task,
            sentence_avg,
            label_smoothing,
            ignore_prefix_size,
            report_accuracy,
            moe_gate_loss_wt,
            moe_z_loss_wt,
            moe_gate_loss_combine_method,
            moe_hide_expert_load,
        )
        values = dict(
            distill_weight=distill_weight, distill_temperature=distill_temperature, distill_top_k=distill_top_k
        )
        check_options(DISTILL_RANGES, values.get)
        self.weight, self.temperature, self.top_k = float(distill_weight), float(distill_temperature), distill_top_k
        found = teachers.find_teacher(distill_teacher)
        teachers.check_fits(found, task)
        vocabulary = len(task.target_dictionary)
        if self.top_k > vocabulary:
            raise MoEOptionError(
                f"--distill-top-k {self.top_k} keeps more tokens than the teacher's {vocabulary}: use at most "
                f"{vocabulary}, or 0 for the whole vocabulary"
            )
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        parallel_size = teachers.teacher_parallel_size(found, distill_teacher_experts, world)
        dtype = teachers.teacher_dtype(distill_teacher_dtype, fp16, bf16, memory_efficient_fp16, memory_efficient_bf16)
        # Not a submodule: see the module's docstring.
        object.__setattr__(self, "teacher", teachers.load_teacher(found, task, dtype, parallel_size))
        self.teacher_placed = False

    def teacher_targets(self, sample, positions):
        """The teacher's log q at the target ``positions`` (a [B, T] mask), and the K tokens kept (or None)."""
        if not self.teacher_placed:
            object.__setattr__(self, "teacher", self.teacher.to(sample["target"].device))
            self.teacher_placed = True
        with torch.no_grad():
            logits = self.teacher(**sample["net_input"])[0]
            cache = find_moe_cache(self.teacher)
            if cache is not None:
                cache.collect()  # the teacher's own balance losses: dropped, never the student's
            logits = logits[:, self.ignore_prefix_size :][positions].float() / self.temperature
            if self.top_k:
                logits, index = logits.topk(self.top_k, dim=-1)
                return F.log_softmax(logits, dim=-1), index
            return F.log_softmax(logits, dim=-1), None

    def forward(self, model, sample, reduce=True):
        target = sample["target"][:, self.ignore_prefix_size :]
        positions = target.ne(self.padding_idx)
        # The teacher first: its activations are gone before the student's are made.
        teacher_log_probs, teacher_index = self.teacher_targets(sample, positions)
        with summing_losses(model):  # the student's MoE losses summed over workers once, in add_moe_losses
            net_output = model(**sample["net_input"])
        smoothed, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        student_logits = net_output[0][:, self.ignore_prefix_size :][positions]
        kl = kl_per_token(student_logits, teacher_log_probs, teacher_index, self.temperature)
        if reduce:
            kl = kl.sum()
        else:  # one value per target position of the batch, as compute_loss gives them
            kl = torch.zeros(positions.shape, dtype=kl.dtype, device=kl.device).masked_scatter(positions, kl).view(-1)
            smoothed = smoothed.view(-1)
        weight = self.weight
        loss = (1 - weight) * smoothed + (weight * self.temperature**2) * kl.to(smoothed.dtype)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "distill_kl": kl.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = n_correct.data
            logging_output["total"] = total.data
        loss = self.add_moe_losses(model, loss, sample_size, logging_output, reduce)
        return loss, sample_size, logging_output

    def add_moe_losses(self, model, loss, sample_size, logging_output, reduce=True):
        if find_moe_cache(model) is None:  # a dense student
            return loss
        return super().add_moe_losses(model, loss, sample_size, logging_output, reduce)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        kl = sum(log.get("distill_kl", 0) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        metrics.log_scalar("distill_kl", kl / max(ntokens, 1) / math.log(2), ntokens, round=4)
