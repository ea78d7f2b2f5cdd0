"""Mixed precision as fairseq users type it (--bf16, --amp, --fp16) in MoE training, and what fairseq
does when a step produces NaN/inf (crash.pt, NanDetector). Hooks 11-15 of the table in ``__init__``.

Why each one exists, in fairseq 0.12.3:

* options.parse_args_and_arch turns --bf16 (and --memory-efficient-bf16) into --tpu, and the Trainer
  then asks torch_xla for its device: bf16 could not run on CUDA or CPU at all.
* Trainer._build_optimizer: plain --fp16 flattens every fp32 gradient into one buffer, which drops the
  ``expert`` marker the global gradient norm needs, and on several workers experts would be clipped
  per worker. The choice is made when the optimizer is built, before any batch runs.
* AMPOptimizer: GradScaler skips a step on a worker's *local* found-inf, and expert gradients are
  never all-reduced, so one worker could skip while another steps. The gradient norm is already
  global (grad_norm.global_grad_norm), so it decides for every worker. fairseq also unscales twice
  (clip_grad_norm unscales the torch optimizer, step() then unscales the fairseq wrapper, a second
  GradScaler state); stepping the optimizer that was unscaled fixes both.
* Trainer.save_checkpoint: on a NaN/inf error every worker of an MoE run saves ``crash.pt``; the
  workers would write and rename the same file.
* NanDetector: torch's (legacy) backward hooks walk a module's output by ``output[0]``, which fails
  on the router's ``Routing`` dataclass (and on the encoder's dict of lists) and hides where the NaN
  came from; its forward hook does not look inside a dataclass.
"""

import dataclasses
import functools
import importlib.util
import logging
import sys
from itertools import chain

import torch
from omegaconf import open_dict
from torch.amp.grad_scaler import OptState

from ..checkpoint import rank_suffix, split_rank_suffix
from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..common.torch_compat import scaler_optimizer_state
from ..parallel import expert_grads
from ..parallel.fully_sharded import is_sharded, local_part
from ..parallel.process_state import STATE
from . import sharding
from .inference import add_inference_experts_flag, decide_inference_run
from .saving import is_expert_parallel_trainer

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- 11. --bf16 does not imply --tpu


def wrap_parse_args_and_arch(original):
    @functools.wraps(original)
    def parse_args_and_arch(parser, input_args=None, *args, **kwargs):
        add_inference_experts_flag(parser)
        result = original(parser, input_args, *args, **kwargs)
        parsed = result[0] if isinstance(result, tuple) else result
        argv = sys.argv[1:] if input_args is None else input_args
        keep_tpu_off_unless_asked(parsed, "--tpu" in argv)
        decide_inference_run(parsed)
        return result

    return parse_args_and_arch


def keep_tpu_off_unless_asked(args, tpu_asked: bool) -> None:
    """fairseq sets ``args.tpu`` for every --bf16 run; leave it on only when the user asked for a TPU
    (fairseq's parser takes no abbreviations, so ``--tpu`` is spelt out) and torch_xla is there."""
    if not config_value(args, "tpu", False):
        return
    if tpu_asked:
        if importlib.util.find_spec("torch_xla") is None:
            raise MoEOptionError(
                "--tpu needs torch_xla, which is not installed: install torch_xla, or drop --tpu "
                "(--bf16 alone trains on CUDA or CPU)"
            )
        return
    args.tpu = False
    if config_value(args, "bf16", False):
        logger.info("--bf16 trains on the CUDA device (or the CPU with --cpu), not on a TPU: add --tpu for a TPU")


# ---------------------------------------------------------------- 12. --fp16 keeps the expert marker


def wrap_build_optimizer(original):
    @functools.wraps(original)
    def _build_optimizer(self):
        common = self.cfg.common
        if (common.fp16 or common.bf16) and sharding.is_fully_sharded_backend(self.cfg.distributed_training):
            return build_fully_sharded_mixed_precision_optimizer(self)
        flattens = common.fp16 and not (common.memory_efficient_fp16 or common.bf16 or common.fp16_no_flatten_grads)
        if flattens and needs_expert_marker(self):
            with open_dict(common):
                common.fp16_no_flatten_grads = True
            logger.info(
                "--fp16 with experts on several workers: fp16 gradients are kept per parameter "
                "(--fp16-no-flatten-grads) so the gradient norm can count every worker's experts"
            )
        return original(self)

    return _build_optimizer


def build_fully_sharded_mixed_precision_optimizer(trainer) -> None:
    """--fp16/--bf16 under fully_sharded: the parameters the optimizer sees are fp32 (FSDP2's shards,
    the experts' fp32 weights), so no fp32 copy is made (fairseq's FP16Optimizer would copy them).
    fairseq's MemoryEfficientFP16Optimizer steps them in place and keeps its dynamic loss scaling for
    fp16 (none for bf16), as fairseq does for its own fully_sharded backend; any optimizer is allowed,
    since none of them sees a low-precision tensor. Its overflow check reads the global gradient norm
    (hook 4), so every worker skips an overflowing step and lowers the scale alike."""
    from fairseq.optim import lr_scheduler

    from fairseq import optim

    params = [p for p in chain(trainer.model.parameters(), trainer.criterion.parameters()) if p.requires_grad]
    fp32_optimizer = optim.build_optimizer(trainer.cfg.optimizer, params)
    trainer._optimizer = optim.MemoryEfficientFP16Optimizer(trainer.cfg, params, fp32_optimizer, allow_unsupported=True)
    trainer._lr_scheduler = lr_scheduler.build_lr_scheduler(trainer.cfg.lr_scheduler, trainer.optimizer)
    trainer._lr_scheduler.step_update(0)


def needs_expert_marker(trainer) -> bool:
    """Several workers and expert parameters: the gradient norm must tell experts from shared weights."""
    # The unwrapped model: touching trainer.model would build the DDP wrapper here.
    return trainer.data_parallel_world_size > 1 and expert_grads.has_experts(trainer._model)


# ---------------------------------------------------------------- 13. --amp skips on every worker or none


def wrap_amp_clip_grad_norm(original):
    @functools.wraps(original)
    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        scaler = self.scaler
        if scaler.is_enabled() and "unscale_" not in vars(scaler) and any(map(is_sharded, self.fp32_optimizer.params)):
            scaler.unscale_ = functools.partial(unscale_local_parts, scaler)
        grad_norm = original(self, max_norm, aggregate_norm_fn)
        STATE.amp_overflow[self] = not bool(torch.isfinite(grad_norm).all())
        return grad_norm

    return clip_grad_norm


def wrap_amp_step(original):
    @functools.wraps(original)
    def step(self):
        scaler = self.scaler
        overflow = STATE.amp_overflow.pop(self, None)
        if not scaler.is_enabled():
            return original(self)
        if overflow:
            mark_overflow(scaler, self.optimizer)
        scaler.step(self.optimizer)  # the optimizer clip_grad_norm unscaled: not a second unscale
        scaler.update()

    return step


def unscale_local_parts(scaler, optimizer) -> None:
    """GradScaler.unscale_ for an optimizer holding FSDP2's slices (DTensors) beside plain expert
    tensors, which torch's one foreach unscale per device refuses: the same record and the same
    kernel, on each gradient's local part (``--amp`` under --ddp-backend fully_sharded). The found-inf
    is this worker's; the global gradient norm makes it every worker's (``mark_overflow``)."""
    state = scaler_optimizer_state(scaler, optimizer)
    if state["stage"] is not OptState.READY:
        raise RuntimeError(f"unscale_() called at stage {state['stage']} of this optimizer's update")
    inv_scale = scaler._scale.double().reciprocal().float()
    grads = {}  # by device and dtype, as torch groups them
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                grad = local_part(p.grad)
                grads.setdefault(grad.device, {}).setdefault(grad.dtype, []).append(grad)
    found = {}
    for device, by_dtype in grads.items():
        found[device] = torch.zeros((), dtype=torch.float32, device=device)
        for same in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same, found[device], inv_scale.to(device))
    state["found_inf_per_device"] = found
    state["stage"] = OptState.UNSCALED


def mark_overflow(scaler, optimizer) -> None:
    """Make ``scaler.step(optimizer)`` skip and ``scaler.update()`` back off, as if this worker had
    found the inf itself. Before clip_grad_norm unscaled the gradients there is nothing recorded yet:
    unscale here, so the record exists."""
    state = scaler_optimizer_state(scaler, optimizer)
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    for found_inf in state["found_inf_per_device"].values():
        found_inf.fill_(1.0)


# ---------------------------------------------------------------- 14. one crash file per worker


def wrap_trainer_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(self, filename, extra_state):
        return original(self, per_worker_name(self, filename), extra_state)

    return save_checkpoint


def per_worker_name(trainer, filename: str) -> str:
    """``crash.pt`` (the only name fairseq saves under without the trainer's suffix) becomes
    ``crash-rank-R-of-W.pt`` when every worker of an MoE run saves."""
    if not filename.endswith(".pt") or not is_expert_parallel_trainer(trainer):
        return filename
    if split_rank_suffix(filename)[1] is not None:
        return filename
    suffix = rank_suffix(trainer.data_parallel_rank, trainer.data_parallel_world_size)
    return filename[: -len(".pt")] + suffix + ".pt"


# ---------------------------------------------------------------- 15. NanDetector sees MoE outputs


def wrap_nan_detector_add_hooks(original):
    @functools.wraps(original)
    def add_hooks(self, module):
        if self.forward:
            self.fhooks.append(module.register_forward_hook(self.fhook_fn))
        if self.backward:
            # What torch's legacy backward hook does (hook the grad_fn of the output's first tensor),
            # for any output: torch finds that tensor by output[0], which fails on a dataclass (the
            # router's Routing) and, with StopIteration, on fairseq's encoder output (a dict of lists).
            self.bhooks.append(module.register_forward_hook(functools.partial(_hook_backward, self)))

    return add_hooks


def _hook_backward(detector, module, inputs, output):
    tensor = first_tensor(output)
    if tensor is not None and tensor.grad_fn is not None:
        tensor.grad_fn.register_hook(
            lambda grad_inputs, grad_outputs: detector.bhook_fn(module, grad_inputs, grad_outputs)
        )


def first_tensor(value):
    if torch.is_tensor(value):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, field.name) for field in dataclasses.fields(value)]
    elif isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def wrap_nan_detector_apply(original):
    @functools.wraps(original)
    def _apply(self, module, inp, x, backward):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            x = tuple(getattr(x, field.name) for field in dataclasses.fields(x))
        return original(self, module, inp, x, backward)

    return _apply
