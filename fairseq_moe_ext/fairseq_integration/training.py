"""Hooks 2, 3, 4, 9, 18 and 19: fairseq's distributed training keeps experts apart, its set-up errors
surface before the first batch, loss-free balancing biases move after each optimizer step (and the
global-batch balance counts start afresh before each), the rows
the experts received are logged per update, and running out of memory stops a job whose MoE
collectives cross workers instead of leaving its other workers waiting in them."""

import dataclasses
import functools
import logging
import os
import sys

import torch
from fairseq.distributed import DistributedTimeoutWrapper, ModuleProxyWrapper
from fairseq.logging import metrics

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError, MoERefusal, MoESetupError
from ..common.torch_compat import ignore_in_ddp
from ..criterions.moe_criterions import MoELossMixin, find_moe_cache
from ..moe import rows_received
from ..moe.balance_bias import balance_biases, update_balance_biases
from ..moe.balance_scope import start_update
from ..moe.comm import MoECommunicationError
from ..moe.stop_notice import announce_stop
from ..options import moe_options
from ..parallel import expert_grads, grad_norm
from ..parallel.fully_sharded import is_sharded
from ..parallel.plan import plan_of
from ..parallel.process_state import STATE
from . import sharding

logger = logging.getLogger(__name__)


def wrap_torchrun_init(original):
    @functools.wraps(original)
    def infer_torch_distributed_launch_init(cfg):
        if torch.cuda.device_count() > 0:
            return original(cfg)
        cfg.distributed_init_method = "env://"
        cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
        cfg.distributed_rank = int(os.environ["RANK"])
        cfg.device_id = 0  # infer_init_method calls torch.cuda.set_device for any id > 0
        cfg.distributed_no_spawn = True
        if cfg.distributed_backend == "nccl":
            logger.info("no CUDA device: using the gloo backend for torchrun workers")
            cfg.distributed_backend = "gloo"

    return infer_torch_distributed_launch_init


def wrap_single_node_init(original):
    @functools.wraps(original)
    def infer_single_node_init(cfg):
        world, devices = cfg.distributed_world_size, torch.cuda.device_count()
        if world > devices:  # fairseq asserts "world size is N but have 0 available devices"
            tool = os.path.basename(sys.argv[0])
            tool = tool if tool.startswith("fairseq-") else "fairseq-train"
            raise MoEOptionError(
                f"--distributed-world-size {world} with {devices} CUDA devices: fairseq starts workers itself only "
                f"on GPUs; start {world} CPU workers with torchrun --nproc_per_node {world} $(which {tool}) "
                f"... --distributed-world-size {world} (or drop --distributed-world-size for one process)"
            )
        return original(cfg)

    return infer_single_node_init


def wrap_distributed_model(original):
    @functools.wraps(original)
    def distributed_fairseq_model(args, model, process_group, device):
        backend = args.ddp_backend
        moe = expert_grads.has_experts(model)
        if moe and backend not in expert_grads.SUPPORTED_DDP_BACKENDS:
            raise expert_grads.unsupported_backend_error(backend)
        if getattr(model, "parallel_plan", None) is not None:
            # The backend is fairseq's to hand only to its wrapper (a model built from its own config section,
            # as moe_transformer_lm is, never saw --ddp-backend): the plan takes it here, before any use.
            model.parallel_plan = dataclasses.replace(model.parallel_plan, backend=str(backend))
        if backend == "fully_sharded":  # torch FSDP2 for every model (hooks 20-22), experts left out
            wrapped = sharding.shard_for_training(args, model, process_group, device)
        else:
            if moe:
                model = model.to(device)
                expert_grads.check_shared_parameters_agree(model, process_group)
                if backend in ("c10d", "pytorch_ddp"):
                    ignore_in_ddp(model, expert_grads.expert_parameter_names(model))
            wrapped = _data_parallel(original, args, model, process_group, device)
        if not moe:
            STATE.training_plan = None  # a dense model (a distilled student) trains no expert
            return wrapped
        plan = plan_of(model)
        # With --moe-freeze experts no gradient carries the marker, and none lost it.
        experts_train = any(expert_grads.is_expert(p) and p.requires_grad for p in model.parameters())
        STATE.training_plan = plan if experts_train else None
        return expert_grads.ExpertParallelModel(
            wrapped,
            torch.distributed.get_world_size(process_group),
            replica_group=plan.replica_group,
            expert_grad_factor=plan.expert_grad_factor,
        )

    return distributed_fairseq_model


def _data_parallel(original, args, model, process_group, device):
    if args.ddp_backend not in ("c10d", "pytorch_ddp") or device.type != "cpu":
        return original(args, model, process_group, device)
    # fairseq passes device_ids=[device_id], which torch refuses for CPU modules.
    wrapped = ModuleProxyWrapper(
        torch.nn.parallel.DistributedDataParallel(
            module=model.to(device),
            broadcast_buffers=args.broadcast_buffers,
            bucket_cap_mb=args.bucket_cap_mb,
            process_group=process_group,
            find_unused_parameters=args.find_unused_parameters,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
        )
    )
    if config_value(args, "heartbeat_timeout", -1) > 0:  # fairseq's own branch adds its watchdog too
        wrapped = DistributedTimeoutWrapper(wrapped, timeout=args.heartbeat_timeout)
    return wrapped


def wrap_clip_grad_norm(original):
    @functools.wraps(original)
    def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if any(expert_grads.is_expert(p) or is_sharded(p) for p in params):  # experts, or FSDP2's slices
            if aggregate_norm_fn is not None:
                raise expert_grads.unsupported_backend_error("fully_sharded")
            # fairseq hands over the parameters alone: the group is that of the model being trained.
            plan = STATE.training_plan
            return grad_norm.clip_grad_norm_(params, max_norm, None if plan is None else plan.parallel_group)
        if STATE.training_plan is not None and params:
            raise MoESetupError(
                "the optimizer's parameters lost the expert marker (--fp16 flattens gradients into one "
                "buffer), so expert gradients would be clipped per worker: add --fp16-no-flatten-grads"
            )
        return original(params, max_norm, aggregate_norm_fn)

    return clip_grad_norm_


def wrap_prepare_sample(original):
    @functools.wraps(original)
    def _prepare_sample(self, *args, **kwargs):
        sample, is_dummy = original(self, *args, **kwargs)
        STATE.dummy_batch = bool(is_dummy)
        return sample, is_dummy

    return _prepare_sample


def wrap_train_step(original):
    @functools.wraps(original)
    def train_step(self, *args, **kwargs):
        # fairseq's --amp retry calls train_step again from inside itself: the outermost call decides.
        layers = rows_received.moe_layers(self._model)
        # --moe-balance-scope global-batch counts within one update: every update (and an --amp retry of
        # one) starts from nothing, so a skipped step leaves nothing behind and a resume counts the same.
        start_update(self._model)
        if not layers or getattr(self, "_moe_in_train_step", False):
            return original(self, *args, **kwargs)
        before = self.get_num_updates()
        rows_received.take_peak(self._model)  # forget validation's and generation's calls
        self._moe_in_train_step = True
        try:
            result = original(self, *args, **kwargs)
        finally:
            self._moe_in_train_step = False
        # Every worker reaches this point together (a skipped step is skipped everywhere), so the
        # all-reduces below line up; the load counted over every micro-batch of the update is
        # spent here, and dropped when the optimizer step was skipped (overflow).
        if balance_biases(self._model):
            update_balance_biases(self._model, stepped=self.get_num_updates() > before)
        peak = rows_received.peak_over_workers(rows_received.take_peak(self._model), layers[0].statistics_group)
        metrics.log_scalar("moe_max_rows_received", peak, weight=1, round=0)
        return result

    return train_step


class MoEOutOfMemoryError(MoERefusal, RuntimeError):
    """A worker of a job whose MoE collectives cross workers ran out of device memory."""


def wrap_log_oom(original):
    @functools.wraps(original)
    def _log_oom(self, exc):
        if isinstance(exc, MoECommunicationError):  # a peer's stop relayed (stop_notice.py), not ours
            raise exc
        original(self, exc)  # fairseq's log line (with torch's message) and CUDA memory summary
        layers = rows_received.moe_layers(self._model)
        if not layers or layers[0].statistics_group is None:
            return  # no collective crosses workers: fairseq's recovery (skip the batch) is safe
        raise out_of_memory_error(self, exc, layers) from exc

    return _log_oom


def out_of_memory_error(trainer, exc, layers) -> MoEOutOfMemoryError:
    """fairseq would skip the batch on this worker alone; the others would wait in the MoE layers'
    collectives until their timeout (on NCCL the watchdog's). Stop, and say so to the others."""
    training = trainer._model.training
    capacity = "--moe-capacity-factor" if training else "--moe-eval-capacity-factor"
    rows = max(layer.rows_received_peak for layer in layers)
    received = (
        f"its experts received up to {rows} rows per MoE call" if rows else "its experts had received no rows yet"
    )
    # No "out of memory" in the line: fairseq would take a peer's relayed copy for its own OOM.
    message = (
        f"worker {trainer.data_parallel_rank} of {trainer.data_parallel_world_size} ran out of device memory in "
        f"{'training' if training else 'validation'} (torch's message is logged above); skipping the batch on this "
        f"worker alone would leave the others waiting in the MoE layers' collectives, so the job stops: {received}; "
        f"bound them with {capacity} (e.g. 1.25) or lower --max-tokens"
    )
    announce_stop(message)
    return MoEOutOfMemoryError(message)


def check_training_setup(trainer) -> None:
    """Configuration errors that would otherwise surface inside Trainer.train_step, where fairseq
    answers an error by writing crash.pt (and the batch-prefetching thread may still be running)."""
    model_cfg = trainer.cfg.model
    arch = config_value(model_cfg, "arch") or config_value(model_cfg, "_name")
    # The unwrapped model and criterion: touching trainer.model would build the DDP wrapper here.
    criterion = trainer._criterion
    if isinstance(criterion, MoELossMixin) and criterion.needs_moe_model and find_moe_cache(trainer._model) is None:
        criterion = config_value(trainer.cfg.criterion, "_name")
        raise MoEOptionError(
            f"MoE criterions need an MoE model: --criterion {criterion} collects MoE balance losses, but "
            f"--arch {arch} has no MoE layers; use --arch moe_transformer* / moe_transformer_lm*, or a non-MoE "
            f"criterion such as cross_entropy"
        )
    check_balance_scope(model_cfg, trainer.cfg.criterion)
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and not torch.distributed.is_initialized() and expert_grads.has_experts(trainer._model):
        raise MoEOptionError(
            f"the launcher started {launched} workers (WORLD_SIZE={launched}) but fairseq runs each of them as "
            f"a 1-worker job, so every worker would train its own copy of every expert and write the same "
            f"checkpoint files: add --distributed-world-size {launched}"
        )


def check_balance_scope(model_cfg, criterion_cfg) -> None:
    """--moe-balance-scope (a model option) shapes the balance loss, whose weight is the criterion's."""
    scope = str(moe_options(model_cfg).moe_balance_scope)
    weight = moe_options(criterion_cfg).moe_gate_loss_wt
    if scope == "global-batch" and weight is not None and float(weight) == 0.0:
        raise MoEOptionError(
            "--moe-balance-scope global-batch chooses which tokens the balance loss counts, but --moe-gate-loss-wt 0 "
            "turns that loss off: give it a weight (e.g. --moe-gate-loss-wt 0.01) or drop --moe-balance-scope"
        )
