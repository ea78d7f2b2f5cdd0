"""``--criterion moe_distillation`` against a hand computation, in this process: on a tiny batch its loss is
(1 - w) times fairseq's label-smoothed cross-entropy plus w T^2 times the KL of the teacher's softened
distribution (whole, or its top K renormalised) from the student's, written here from the definitions, and
its gradient with respect to the student's logits is (1 - w) times the smoothed cross-entropy's plus
w T (softmax(z / T) - q). An MoE student adds its own balance losses, never the teacher's; the teacher never
changes, never trains and is never saved with the student."""

import math

import pytest
import torch
import torch.nn as nn

from fairseq_moe_ext.criterions.moe_criterions import find_moe_cache
from support.inputs.distillation import distilled, write_teacher
from support.launch.in_process_trainer import build_trainer, collate, sentence_pairs, training_args, write_dictionaries

EPS = 0.1  # the oracle's --label-smoothing


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("distillation")
    data_dir = str(root / "data")
    write_dictionaries(data_dir)
    return data_dir, write_teacher(data_dir, root / "teacher.pt")


class FixedLogits(nn.Module):
    """A "model" whose output is a leaf tensor of logits: the criterion's gradient with respect to them."""

    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(logits.clone())

    def forward(self, **net_input):
        return self.logits, {"attn": [None]}

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        return torch.log_softmax(net_output[0].float(), dim=-1) if log_probs else torch.softmax(net_output[0], -1)

    def get_targets(self, sample, net_output):
        return sample["target"]


def hand_loss_and_gradient(z, u, target, pad, weight, temperature, top_k):
    """(loss, d loss / d z) from the definitions, position by position: z the student's logits, u the teacher's."""
    vocabulary = z.shape[-1]
    eps_i = EPS / (vocabulary - 1)
    loss, grad = torch.zeros((), dtype=torch.float64), torch.zeros(z.shape, dtype=torch.float64)
    for b, t in ((b, t) for b in range(z.shape[0]) for t in range(z.shape[1])):
        y = int(target[b, t])
        if y == pad:
            continue
        zt, ut = z[b, t].double(), u[b, t].double()
        p = torch.exp(zt - torch.logsumexp(zt, 0))
        smoothed = (1 - EPS - eps_i) * -math.log(p[y]) + eps_i * -torch.log(p).sum()
        d_smoothed = (1 - EPS - eps_i) * (p - torch.eye(vocabulary, dtype=torch.float64)[y]) + eps_i * (
            vocabulary * p - 1
        )
        s = torch.exp(zt / temperature - torch.logsumexp(zt / temperature, 0))
        kept = torch.topk(ut, top_k).indices if top_k else torch.arange(vocabulary)
        q = torch.zeros(vocabulary, dtype=torch.float64)
        q[kept] = torch.exp(ut[kept] / temperature - torch.logsumexp(ut[kept] / temperature, 0))
        kl = sum(float(q[v] * (math.log(q[v]) - math.log(s[v]))) for v in kept.tolist())
        loss += (1 - weight) * smoothed + weight * temperature**2 * kl
        grad[b, t] = (1 - weight) * d_smoothed + weight * temperature * (s - q)
    return loss, grad


def student_of(teacher, *flags, dense=True, seed="5"):
    data_dir, path = teacher
    argv = distilled(training_args(data_dir, 1, ["--seed", seed]), path, *flags, dense=dense)
    return build_trainer(argv)


@pytest.mark.parametrize("top_k", [0, 5], ids=["whole-vocabulary", "top-5"])
def test_loss_and_gradient_equal_the_hand_computed_mix_of_smoothed_ce_and_kl(teacher, top_k):
    weight, temperature = 0.3, 2.0
    task, trainer = student_of(
        teacher,
        "--distill-weight",
        str(weight),
        "--distill-temperature",
        str(temperature),
        "--distill-top-k",
        str(top_k),
    )
    criterion = trainer.criterion
    sample = collate(task, sentence_pairs(5, seed=3))
    assert sample["target"].eq(criterion.padding_idx).any(), "the batch should hold pads (left out of the loss)"
    teacher_logits = criterion.teacher(**sample["net_input"])[0].detach()
    z = torch.randn(teacher_logits.shape, generator=torch.Generator().manual_seed(0))
    student = FixedLogits(z)
    loss, sample_size, logged = criterion(student, sample)
    loss.backward()

    want_loss, want_grad = hand_loss_and_gradient(
        z, teacher_logits, sample["target"], criterion.padding_idx, weight, temperature, top_k
    )
    assert sample_size == sample["ntokens"]
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(student.logits.grad.double(), want_grad, rtol=1e-4, atol=1e-6)
    assert float(logged["nll_loss"]) == pytest.approx(
        float(torch.nn.functional.cross_entropy(z.view(-1, z.shape[-1]), sample["target"].view(-1), reduction="sum",
                                                ignore_index=criterion.padding_idx)), rel=1e-5)  # fmt: skip


def test_the_teacher_is_the_checkpoint_s_model_in_eval_mode_without_gradients(teacher):
    from fairseq import checkpoint_utils

    _, trainer = student_of(teacher)
    held = trainer.criterion.teacher
    (saved,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(teacher[1])])
    assert not held.training and not any(p.requires_grad for p in held.parameters())
    want = saved.state_dict()
    assert set(held.state_dict()) == set(want)
    for name, tensor in held.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_an_moe_student_adds_its_own_balance_losses_and_none_of_the_teacher_s(teacher):
    task, trainer = student_of(teacher, "--distill-weight", "0.4", dense=False)
    criterion, model = trainer.criterion, trainer.model
    sample = collate(task, sentence_pairs(6, seed=4))
    loss, _, logged = criterion(model, sample)
    assert len(find_moe_cache(criterion.teacher)) == 0, "the teacher's cache is emptied after its forward"
    assert float(loss.detach()) == pytest.approx(float(logged["loss"]) + logged["moe_aux_loss"], rel=1e-6)
    # The student's own balance losses, as the plain MoE criterion collects them from the same forward.
    model(**sample["net_input"])
    records = find_moe_cache(model).collect()
    balance = torch.stack([r.aux.balance_loss for r in records]).mean()
    z_loss = torch.stack([r.aux.z_loss for r in records]).mean()
    want = sample["ntokens"] * (0.5 * balance + 0.05 * z_loss)  # the oracle's --moe-gate-loss-wt / --moe-z-loss-wt
    assert logged["moe_aux_loss"] == pytest.approx(float(want), rel=1e-5)


def test_the_teacher_never_changes_never_trains_and_is_never_saved(teacher):
    task, trainer = student_of(teacher, "--distill-weight", "0.5", dense=False)
    held = trainer.criterion.teacher
    before = {n: t.clone() for n, t in held.state_dict().items()}
    student_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for step in range(3):
        trainer.train_step([collate(task, sentence_pairs(8, seed=10 + step))])
    assert trainer.get_num_updates() == 3
    for name, tensor in held.state_dict().items():
        assert torch.equal(tensor, before[name]), f"the teacher's {name} changed"
    assert all(p.grad is None for p in held.parameters())
    stepped = {id(p) for group in trainer.optimizer.optimizer.param_groups for p in group["params"]}
    assert not stepped & {id(p) for p in held.parameters()}, "the teacher's parameters are in the optimizer"
    assert any(not torch.equal(p, student_before[n]) for n, p in trainer.model.named_parameters()), "the student trains"
    assert list(trainer.criterion.parameters()) == [] and list(trainer.criterion.buffers()) == []
    trainer.consolidate_optimizer()
    state = trainer.state_dict()
    assert set(state["model"]) == set(trainer.model.state_dict())
    assert state.get("criterion") is None, "fairseq saves a criterion's state only when it has parameters"
    assert state["cfg"]["criterion"]["distill_teacher"] == str(teacher[1])


@pytest.mark.parametrize("flags, want", [([], torch.bfloat16), (["--distill-teacher-dtype", "float32"], torch.float32)])
def test_the_teacher_runs_in_the_student_s_precision_or_its_own(teacher, flags, want):
    task, trainer = student_of(teacher, "--bf16", *flags, dense=False)
    held = trainer.criterion.teacher
    assert {p.dtype for p in held.parameters()} == {want}
    trainer.train_step([collate(task, sentence_pairs(8, seed=2))])
    assert trainer.get_num_updates() == 1 and {p.dtype for p in held.parameters()} == {want}
