"""Every place where this plugin reaches into fairseq internals, in one module.

Checked against fairseq 0.12.3 (ve-fairseq==0.12.3, the same sources as fairseq-fixed==0.12.3.1) and
torch 2.13. ``install()`` runs when fairseq imports the ``--user-dir`` package, which happens before
argument parsing and before distributed initialisation, in every worker and in every fairseq CLI.
``tests/test_fairseq_integration.py`` fails if any hooked function changes under us.

Hooks:
  1. checkpoint_utils.load_checkpoint_to_cpu: torch >= 2.6 unpickles with ``weights_only=True``;
     fairseq checkpoints hold a few plain Python types beyond tensors. We allow exactly those (see
     ``CHECKPOINT_SAFE_GLOBALS``) for the duration of fairseq's load, keep the check on, and turn
     torch's multi-line refusal into one line naming the offending type. A single file is first
     checked whole (torch.load verifies none of the CRC-32s torch.save writes): a truncated or
     corrupted file is refused in one line instead of loading wrong weights or failing in miniz.
     A file holding no fairseq checkpoint (a tensor, a list, another dict), on which fairseq's
     upgrade code fails, is refused in one line (NotACheckpointError).
  2. distributed.utils._infer_torch_distributed_launch_init: under torchrun it computes
     ``rank % torch.cuda.device_count()`` (ZeroDivisionError on CPU). Without CUDA every worker
     uses device 0 (the CPU) and the default nccl backend becomes gloo.
  3. models.DistributedFairseqModel (called by the trainer): for models with expert parameters,
     check the backend, verify shared parameters agree across workers, keep experts out of torch
     DDP's broadcast and all-reduce (its documented ignore list), and wrap the result so expert
     gradients are scaled to match the single-process update. For any model, c10d/pytorch_ddp on
     CPU gets no device_ids (fairseq passes [device_id], which torch refuses for CPU modules),
     and keeps fairseq's --heartbeat-timeout watchdog (DistributedTimeoutWrapper) that fairseq's
     own branch would have added.
  4. utils.clip_grad_norm_ (called by every fairseq optimizer): with expert parameters present the
     norm is the global one (distributed.global_grad_norm); fairseq's own leaves experts out.
  5. Trainer.checkpoint_suffix / should_save_checkpoint_on_current_rank / state_dict: in multi-worker
     MoE training every worker saves, under a ``-rank-R-of-W`` suffix, and only rank 0 stores the
     shared state. All of fairseq's naming, --save-interval*, --keep-* and best/last logic is kept.
     ``state["moe"]`` makes each file self-describing: rank, world size, ``experts_held`` and the
     save's ``set_id`` (set_identity.py: derived on every worker without a collective; the manifest
     records it only when every worker derived the same one).
  6. checkpoint_utils.save_checkpoint: before it, every complete set is hard-linked as
     ``<name>.prev`` and fairseq's in-place copies become copy + rename, so a crash mid-save leaves
     the previous set loadable; afterwards the workers' new files are described (size, sha256),
     rank 0 writes one manifest per complete set (with the set id), last and atomically, removes
     the manifests of sets that --keep-* pruned, and drops the ``.prev`` generations. fairseq's pruning
     (``os.remove`` in save_checkpoint) is deferred until after that, behind a barrier, so no
     manifest ever lists a deleted file. A ``*.set.json`` in the save dir that is not a well-formed
     manifest of ours is ignored with one warning per file and process (checkpoint/foreign.py) and
     left as it is.
  7. Trainer.load_checkpoint and checkpoint_utils.load_checkpoint_to_cpu: a name is resolved to a
     complete set or a single file (the default checkpoint_last falls back to the newest complete
     set with a warning; a --restore-file the user named only with --moe-restore-fallback, see
     restore_choice), merged, and sliced for this worker: resuming works at any world size dividing
     the experts. fairseq-train calls Trainer.load_checkpoint before reading any batch, so it first
     refuses an MoE criterion on a model without MoE layers and workers that torchrun started but
     fairseq runs as separate 1-worker jobs (raised later, inside train_step, fairseq would write
     crash.pt), then claims --save-dir (training_save_dir: rank 0 takes the save dir's lock, and an
     expert-parallel job checks that every worker sees the same directory) before any checkpoint
     is read or written. fairseq-generate and the other tools never call it, so never lock.
     A manifest is checked field by field before any file it lists is opened (checkpoint/manifest.py),
     and a single file that is one rank's part of a set is refused, naming its set.
  8. checkpoint_utils.load_model_ensemble_and_task (generate, interactive, eval-lm, validate, hub):
     ``--path dir/checkpoint_best.pt`` loads a set with no conversion step; models are built with
     every expert local.
  9. Trainer._prepare_sample: records whether the batch about to run is fairseq's dummy batch, so
     MoE layers route none of its tokens (models/moe_layers.DummyBatch) while still joining the
     all-to-all.
 10. argparse.ArgumentParser.error: fairseq adds a model's and a criterion's options only for the
     --arch and --criterion given, so an MoE option beside a dense architecture is "unrecognized";
     the message then also says which architectures (or criterions) the option belongs to.

Precision and NaN/inf hooks, in precision.py (which says why each is needed):
 11. options.parse_args_and_arch: --bf16 / --memory-efficient-bf16 no longer imply --tpu; tpu stays
     on only for an explicit --tpu with torch_xla installed (without torch_xla: a one-line error).
 12. Trainer._build_optimizer: plain --fp16 with experts on several workers builds the non-flattened
     FP16Optimizer (as --fp16-no-flatten-grads, with one log line) before any batch runs.
 13. AMPOptimizer.clip_grad_norm / step: the global gradient norm decides whether every worker skips
     the step (same loss scale everywhere); the torch optimizer unscaled in clip_grad_norm is the one
     stepped, so gradients are unscaled once.
 14. Trainer.save_checkpoint: ``crash.pt`` of a multi-worker MoE run is ``crash-rank-R-of-W.pt``.
 15. nan_detector.NanDetector.add_hooks / _apply: the backward hook goes on the grad_fn of the first
     tensor of any output (torch's legacy hook indexes output[0]: fails on the router's Routing and
     on fairseq's encoder dict), and a dataclass output's tensors are checked, so the detector names
     the module where the NaN/inf appeared instead of failing.
"""

import argparse
import collections
import contextlib
import functools
import logging
import os
import pickle
import sys

import torch
from omegaconf import open_dict

logger = logging.getLogger(__name__)

CHECKED_FAIRSEQ_VERSIONS = ("0.12.2", "0.12.3")

from .checkpoint import CHECKPOINT_SAFE_GLOBALS, UnsafeCheckpointError  # noqa: E402,F401
from .set_identity import agreed_set_id, save_set_id  # noqa: E402

_installed = False


def _wrap_load_checkpoint_to_cpu(original):
    from . import checkpoint as moe_ckpt

    def load_one(path, arg_overrides=None, verified=False, **kwargs):
        """fairseq's load of one file; ``verified``: its sha256 was just checked against a manifest."""
        if not verified:
            moe_ckpt.check_file_intact(path)
        with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
            try:
                return original(path, arg_overrides, **kwargs)
            except (EOFError, RuntimeError, pickle.UnpicklingError) as error:
                one_line = moe_ckpt.unloadable_error(path, error)
                if one_line is None:
                    moe_ckpt.refuse_if_not_a_checkpoint(path)
                    raise
                raise one_line from None
            except (KeyError, TypeError, AttributeError, IndexError):
                # fairseq's upgrade of old checkpoints indexes whatever torch.load returned
                moe_ckpt.refuse_if_not_a_checkpoint(path)
                raise

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, arg_overrides=None, **kwargs):
        return _load_moe_checkpoint(load_one, path, arg_overrides, **kwargs)

    return load_checkpoint_to_cpu


def _wrap_torchrun_init(original):
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


def _wrap_distributed_model(original):
    from . import distributed as moe_dist

    @functools.wraps(original)
    def distributed_fairseq_model(args, model, process_group, device):
        backend = args.ddp_backend
        moe = moe_dist.has_experts(model)
        if moe:
            if backend not in moe_dist.SUPPORTED_DDP_BACKENDS:
                raise moe_dist.unsupported_backend_error(backend)
            model = model.to(device)
            moe_dist.check_shared_parameters_agree(model, process_group)
            if backend in ("c10d", "pytorch_ddp"):
                torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                    model, moe_dist.expert_parameter_names(model)
                )
        if backend in ("c10d", "pytorch_ddp") and device.type == "cpu":
            from fairseq.distributed import ModuleProxyWrapper

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
            if getattr(args, "heartbeat_timeout", -1) > 0:  # fairseq's own branch adds its watchdog too
                from fairseq.distributed import DistributedTimeoutWrapper

                wrapped = DistributedTimeoutWrapper(wrapped, timeout=args.heartbeat_timeout)
        else:
            wrapped = original(args, model, process_group, device)
        if not moe:
            return wrapped
        moe_dist.EXPERT_PARALLEL_TRAINING = True
        return moe_dist.ExpertParallelModel(wrapped, torch.distributed.get_world_size(process_group))

    return distributed_fairseq_model


def _wrap_clip_grad_norm(original):
    from . import distributed as moe_dist

    @functools.wraps(original)
    def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if any(moe_dist.is_expert(p) for p in params):
            if aggregate_norm_fn is not None:
                raise moe_dist.unsupported_backend_error("fully_sharded")
            return moe_dist.clip_grad_norm_(params, max_norm)
        if moe_dist.EXPERT_PARALLEL_TRAINING and params:
            raise RuntimeError(
                "the optimizer's parameters lost the expert marker (--fp16 flattens gradients into one "
                "buffer), so expert gradients would be clipped per worker: add --fp16-no-flatten-grads"
            )
        return original(params, max_norm, aggregate_norm_fn)

    return clip_grad_norm_


# ---------------------------------------------------------------- per-rank checkpoints

_SHARD_FOR = []  # (rank, world_size) while Trainer.load_checkpoint loads a set for one worker


def _is_expert_parallel_trainer(trainer) -> bool:
    from . import distributed as moe_dist

    cached = trainer.__dict__.get("_moe_ext_expert_parallel")
    if cached is None:
        cached = trainer.data_parallel_world_size > 1 and moe_dist.has_experts(trainer._model)
        trainer.__dict__["_moe_ext_expert_parallel"] = cached
    return cached


def _wrap_checkpoint_suffix(original):
    from .checkpoint import rank_suffix

    def checkpoint_suffix(self):
        suffix = original.fget(self)
        if _is_expert_parallel_trainer(self):
            suffix += rank_suffix(self.data_parallel_rank, self.data_parallel_world_size)
        return suffix

    return property(checkpoint_suffix)


def _wrap_should_save(original):
    def should_save_checkpoint_on_current_rank(self):
        return _is_expert_parallel_trainer(self) or original.fget(self)

    return property(should_save_checkpoint_on_current_rank)


def _wrap_trainer_state_dict(original):
    from . import checkpoint as moe_ckpt
    from . import distributed as moe_dist

    @functools.wraps(original)
    def state_dict(self):
        state = original(self)
        if not moe_dist.has_experts(self._model):
            return state
        world = self.data_parallel_world_size
        rank = self.data_parallel_rank if world > 1 else 0
        names = [n for n, p in self._model.named_parameters() if p.requires_grad]
        experts = [p for p in self._model.parameters() if moe_dist.is_expert(p)]
        state["moe"] = moe_ckpt.moe_metadata(
            names, moe_dist.expert_parameter_names(self._model), world, rank, self.get_num_updates(),
            set_id=save_set_id(self, world), experts_per_worker=int(experts[0].shape[0]) if experts else None,
        )
        if rank > 0:
            moe_ckpt.strip_shared_state(state)
        return state

    return state_dict


def _own_checkpoint_files(save_dir, suffix):
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return {}
    ending = suffix + ".pt"
    files = {}
    for name in names:
        if name.endswith(ending):
            st = os.stat(os.path.join(save_dir, name))
            files[name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return files


def _wrap_save_checkpoint(original):
    from . import checkpoint as moe_ckpt
    from . import distributed as moe_dist

    @functools.wraps(original)
    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        if cfg.no_save or not moe_dist.has_experts(trainer._model):
            return original(cfg, trainer, epoch_itr, val_loss)
        suffix = trainer.checkpoint_suffix
        before = _own_checkpoint_files(cfg.save_dir, suffix)
        if not _is_expert_parallel_trainer(trainer):
            result = original(cfg, trainer, epoch_itr, val_loss)
            for name, stamp in _own_checkpoint_files(cfg.save_dir, suffix).items():
                if before.get(name) != stamp:
                    moe_ckpt.remove_other_layouts(moe_ckpt.base_of(os.path.join(cfg.save_dir, name)), world_size=1)
            return result
        with _previous_generation_kept(cfg.save_dir, suffix, trainer), _atomic_copies(), _removals_deferred() as pruned:
            result = original(cfg, trainer, epoch_itr, val_loss)
        after = _own_checkpoint_files(cfg.save_dir, suffix)
        written = [
            dict(moe_ckpt.describe_file(os.path.join(cfg.save_dir, n)), rank=trainer.data_parallel_rank,
                 set_id=save_set_id(trainer, trainer.data_parallel_world_size))
            for n, stamp in after.items() if before.get(n) != stamp
        ]
        removed = [os.path.basename(p) for p in pruned]
        reports = [None] * trainer.data_parallel_world_size
        torch.distributed.all_gather_object(reports, (written, removed))
        if trainer.data_parallel_rank == 0:
            _write_manifests(cfg.save_dir, reports, trainer)
            moe_ckpt.remove_previous_generations(cfg.save_dir)
        # No worker deletes a file of a pruned set before rank 0 has dropped the manifest listing it:
        # a crash in between leaves unlisted files (pruned again by the next save), never a manifest
        # that lists missing files, which no later save would ever clean up.
        torch.distributed.barrier()
        for path in pruned:
            if os.path.lexists(path):
                os.remove(path)
        return result

    return save_checkpoint


@contextlib.contextmanager
def _previous_generation_kept(save_dir, suffix, trainer):
    """Hard-link every worker's files of every complete set to ``<name>.prev``, and write the
    ``.prev`` manifests, before fairseq overwrites any of them, so a crash in the middle of the save
    leaves the previous complete set loadable. The barriers make it hold across workers: without
    them one worker could overwrite its file before another had linked its own, and a kill then
    would leave neither generation complete."""
    from . import checkpoint as moe_ckpt

    rank, world = trainer.data_parallel_rank, trainer.data_parallel_world_size
    manifests = [moe_ckpt.sets_to_protect(save_dir) if rank == 0 else None]
    torch.distributed.broadcast_object_list(manifests, src=0)  # one decision for every worker
    manifests = manifests[0]
    for manifest in manifests:
        moe_ckpt.link_previous_generation(manifest, rank, world)
    torch.distributed.barrier()
    if rank == 0:
        for manifest in manifests:
            moe_ckpt.write_previous_manifest(manifest, world)
    torch.distributed.barrier()
    yield


@contextlib.contextmanager
def _atomic_copies():
    """fairseq copies checkpoint N-1 times with PathManager.copy, which rewrites the destination in
    place; copy to a temporary name and rename instead, so no reader ever sees a half-written file
    and hard links made by _previous_generation_kept keep their contents."""
    from fairseq import checkpoint_utils

    inner = checkpoint_utils.PathManager

    class AtomicCopyPathManager:
        def __getattr__(self, name):
            return getattr(inner, name)

        @staticmethod
        def copy(src, dst, overwrite=False):
            tmp = dst + ".tmp"
            ok = inner.copy(src, tmp, overwrite=True)
            os.replace(tmp, dst)
            return ok

    checkpoint_utils.PathManager = AtomicCopyPathManager()
    try:
        yield
    finally:
        checkpoint_utils.PathManager = inner


@contextlib.contextmanager
def _removals_deferred():
    """fairseq prunes old checkpoints (--keep-interval-updates, --keep-last-epochs,
    --keep-best-checkpoints) with ``os.remove`` inside save_checkpoint, each worker on its own
    schedule; collect those paths instead, so the caller removes them after the manifests."""
    from fairseq import checkpoint_utils

    real_os, pruned = checkpoint_utils.os, []

    class RemovalDeferringOs:
        def __getattr__(self, name):
            return getattr(real_os, name)

        @staticmethod
        def remove(path):
            pruned.append(path)

    checkpoint_utils.os = RemovalDeferringOs()
    try:
        yield pruned
    finally:
        checkpoint_utils.os = real_os


def _write_manifests(save_dir, reports, trainer):
    from . import checkpoint as moe_ckpt
    from . import distributed as moe_dist

    world = len(reports)
    by_base = collections.defaultdict(list)
    for written, _ in reports:
        for entry in written:
            by_base[moe_ckpt.base_of(os.path.join(save_dir, entry["name"]))].append(entry)
    experts = {n: int(p.shape[0]) * world for n, p in trainer._model.named_parameters() if moe_dist.is_expert(p)}
    for base, entries in by_base.items():
        if sorted(e["rank"] for e in entries) == list(range(world)):
            moe_ckpt.write_manifest(base, world, trainer.get_num_updates(), entries, experts,
                                    agreed_set_id(base, entries))
            moe_ckpt.remove_other_layouts(base, world)
        else:
            logger.warning(f"checkpoint {base}: only ranks {sorted(e['rank'] for e in entries)} wrote files; no manifest")
    for _, removed in reports:
        for name in removed:
            manifest = moe_ckpt.manifest_path(moe_ckpt.base_of(os.path.join(save_dir, name)))
            if os.path.exists(manifest):
                os.remove(manifest)


def _wrap_trainer_load_checkpoint(original):
    from . import distributed as moe_dist
    from .restore_choice import resolve_restore
    from .training_save_dir import claim_save_dir

    @functools.wraps(original)
    def load_checkpoint(self, filename, *args, **kwargs):
        _check_training_setup(self)  # fairseq-train calls this first, before any batch is read
        checkpoint_cfg = self.cfg.checkpoint
        claim_save_dir(checkpoint_cfg.save_dir, checkpoint_cfg.no_save, self.data_parallel_rank,
                       self.data_parallel_world_size, every_rank_saves=_is_expert_parallel_trainer(self))
        if not moe_dist.has_experts(self._model):
            return original(self, filename, *args, **kwargs)
        resolved = resolve_restore(filename, checkpoint_cfg, self.checkpoint_suffix,
                                   allow_fallback=bool(_flag(self.cfg.model, "moe_restore_fallback")))
        if resolved is None:
            return original(self, filename, *args, **kwargs)  # fairseq: "no existing checkpoint"
        world = self.data_parallel_world_size
        rank = self.data_parallel_rank if world > 1 else 0
        logger.info(f"loading {resolved.kind} {resolved.path} as worker {rank} of {world}")
        _SHARD_FOR.append((rank, world, self._model, self.cfg.model))
        try:
            # Every worker builds its own slice, so nothing is broadcast from rank 0.
            with open_dict(self.cfg.checkpoint):
                previous = self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks
                self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
            try:
                return original(self, resolved.path, *args, **kwargs)
            finally:
                with open_dict(self.cfg.checkpoint):
                    self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = previous
        finally:
            _SHARD_FOR.pop()

    return load_checkpoint


def _load_moe_checkpoint(original_load, path, arg_overrides=None, **kwargs):
    """A manifest path gives the merged set; inside Trainer.load_checkpoint, this worker's slice."""
    from . import checkpoint as moe_ckpt

    if not os.path.exists(path) or _names_a_rank_file(path):
        # A set named without its rank suffix, or by one of its rank files (which alone holds only
        # one worker's experts): the whole set.
        resolved = moe_ckpt.resolve(path, fallback=False)
        path = resolved.path if resolved is not None else path
    if path.endswith(moe_ckpt.MANIFEST_SUFFIX):
        full = moe_ckpt.load_set(path, lambda f: original_load(f, arg_overrides, verified=True, **kwargs))
    else:
        full = original_load(path, arg_overrides, **kwargs)
        if "moe" in full:
            moe_ckpt.check_whole(full, path)  # a rank file copied out of its set, under any name
        if "moe" not in full or not _SHARD_FOR:
            return full
    if _SHARD_FOR:
        rank, world, model, model_cfg = _SHARD_FOR[-1]
        state = moe_ckpt.shard_state(full, rank, world)
        _check_resumable(path, state, model, model_cfg)
        return state
    return full


def _names_a_rank_file(path) -> bool:
    from . import checkpoint as moe_ckpt

    return moe_ckpt.split_rank_suffix(path)[1] is not None


def _flag(cfg, name):
    if cfg is None:
        return None
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def _layout_flags(cfg):
    """The flags that decide which parameters an MoE model has (beyond their shapes):
    {what: (flag as the user would pass it, value)}."""
    from .models.moe_config import moe_freq

    flags = {"router": ("--moe-router", _flag(cfg, "moe_router"))}
    for side in ("encoder", "decoder"):
        side_freq = _flag(cfg, f"{side}_moe_freq")
        given = argparse.Namespace(moe_freq=_flag(cfg, "moe_freq"), **{f"{side}_moe_freq": side_freq})
        freq = moe_freq(given, side)
        flags[f"{side} freq"] = (f"--{side}-moe-freq" if side_freq is not None else "--moe-freq", freq)
        flags[f"{side} layers"] = (f"--{side}-layers", _flag(cfg, f"{side}_layers"))
    return flags


def _check_resumable(path, state, model, model_cfg=None) -> None:
    """One line instead of torch's page of size mismatches when the run's flags changed."""
    from . import distributed as moe_dist

    params = dict(model.named_parameters())
    mismatched = [k for k, t in state["model"].items() if k in params and tuple(params[k].shape) != tuple(t.shape)]
    world = moe_dist.expert_parallel_world_size()
    for key in mismatched:  # expert counts first: they also change every router's shape
        tensor, param = state["model"][key], params[key]
        if moe_dist.is_expert(param) and tensor.shape[1:] == param.shape[1:]:
            raise ValueError(
                f"{path} holds {tensor.shape[0] * world} experts in {key.rsplit('.experts', 1)[0]}, this model "
                f"{param.shape[0] * world}: resume with the checkpoint's --moe-expert-count, or use a new --save-dir"
            )
    if mismatched:
        key = mismatched[0]
        raise ValueError(
            f"{path} does not fit this model: {key} is {tuple(state['model'][key].shape)} there and "
            f"{tuple(params[key].shape)} here; resume with the architecture flags the checkpoint was trained "
            f"with, or use a new --save-dir"
        )
    if set(state["model"]) == set(model.state_dict()):
        return
    # Other parameters (not other shapes): name the flag that differs, if one of ours does. Without
    # such a flag, fairseq's own error (after its upgrades of old key names) stands.
    saved = _layout_flags(_flag(state.get("cfg"), "model"))
    current = _layout_flags(model_cfg)
    for what, (flag, value) in saved.items():
        this_flag, this_value = current[what]
        if value is not None and this_value is not None and str(value) != str(this_value):
            raise ValueError(
                f"{path} was trained with {flag} {value} and this run has {this_flag} {this_value}, which gives "
                f"the model other parameters: resume with {this_flag} {value}, or use a new --save-dir"
            )


def _wrap_load_model_ensemble_and_task(original):
    from . import checkpoint as moe_ckpt
    from . import distributed as moe_dist

    @functools.wraps(original)
    def load_model_ensemble_and_task(filenames, *args, **kwargs):
        resolved = []
        for name in filenames:
            # No fallback here: generating from another checkpoint than the one named would mislead.
            # A rank file stands for its whole set (alone it holds one worker's experts).
            named_set = not os.path.exists(name) or _names_a_rank_file(name)
            found = moe_ckpt.resolve(name, fallback=False) if named_set else None
            resolved.append(found.path if found is not None else name)
        with moe_dist.all_experts_local():
            return original(resolved, *args, **kwargs)

    return load_model_ensemble_and_task


def _check_training_setup(trainer) -> None:
    """Configuration errors that would otherwise surface inside Trainer.train_step, where fairseq
    answers an error by writing crash.pt (and the batch-prefetching thread may still be running)."""
    from . import distributed as moe_dist
    from .criterions.moe_criterions import MoELossMixin, find_moe_cache

    model_cfg = trainer.cfg.model
    arch = _flag(model_cfg, "arch") or _flag(model_cfg, "_name")
    # The unwrapped model and criterion: touching trainer.model would build the DDP wrapper here.
    if isinstance(trainer._criterion, MoELossMixin) and find_moe_cache(trainer._model) is None:
        criterion = _flag(trainer.cfg.criterion, "_name")
        raise ValueError(
            f"MoE criterions need an MoE model: --criterion {criterion} collects MoE balance losses, but "
            f"--arch {arch} has no MoE layers; use --arch moe_transformer* / moe_transformer_lm*, or a non-MoE "
            f"criterion such as cross_entropy"
        )
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and not torch.distributed.is_initialized() and moe_dist.has_experts(trainer._model):
        raise ValueError(
            f"the launcher started {launched} workers (WORLD_SIZE={launched}) but fairseq runs each of them as "
            f"a 1-worker job, so every worker would train its own copy of every expert and write the same "
            f"checkpoint files: add --distributed-world-size {launched}"
        )


def _wrap_prepare_sample(original):
    from .models.moe_layers import DummyBatch

    @functools.wraps(original)
    def _prepare_sample(self, *args, **kwargs):
        sample, is_dummy = original(self, *args, **kwargs)
        DummyBatch.active = bool(is_dummy)
        return sample, is_dummy

    return _prepare_sample


def _wrap_argparse_error(original):
    @functools.wraps(original)
    def error(self, message):
        return original(self, _explain_unrecognized_moe_option(message) or message)

    return error


def _explain_unrecognized_moe_option(message: str):
    """fairseq adds a model's and a criterion's options to its parser only for the --arch and
    --criterion given, so an MoE option next to a dense one is merely "unrecognized"; say whose it is."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return None
    from fairseq.models import ARCH_MODEL_REGISTRY

    from .criterions.moe_criterions import MoELossConfig
    from .models.moe_config import MoEConfig, MoEEncoderDecoderConfig
    from .models.moe_transformer import MoETransformerLanguageModel, MoETransformerModel

    def options(config):
        return {"--" + name.replace("_", "-") for name in config.__dataclass_fields__ if name != "_name"}

    def archs(*models):
        return ", ".join(sorted(a for a, m in ARCH_MODEL_REGISTRY.items() if m in models))

    owners = {}
    for option in options(MoEEncoderDecoderConfig) - options(MoEConfig):
        owners[option] = ("--arch", "the MoE translation architectures", archs(MoETransformerModel))
    for option in options(MoEConfig):
        owners[option] = ("--arch", "the MoE architectures", archs(MoETransformerModel, MoETransformerLanguageModel))
    for option in options(MoELossConfig):
        owners[option] = ("--criterion", "the MoE criterions", "moe_label_smoothed_cross_entropy, moe_cross_entropy")
    for word in message[len(prefix):].split():
        option = word.split("=", 1)[0]
        if option in owners:
            kind, whose, names = owners[option]
            given = _given_option(kind)
            return (
                f"{message}: {option} is an option of {whose} only ({kind} {names})"
                + (f", not of {kind} {given}" if given else "")
                + f"; pass one of them as {kind}, or drop {option}"
            )
    return None


def _given_option(name: str):
    """The value of ``--arch`` / ``--criterion`` on this process's command line, if any."""
    argv = sys.argv[1:]
    spellings = (name, "-a") if name == "--arch" else (name,)
    for i, word in enumerate(argv):
        if word in spellings and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


# ---------------------------------------------------------------- version pinning of the hooks

ORIGINALS = {}  # "module.attribute" -> fairseq's own object, as found by install()

# fairseq internals the plugin relies on without wrapping them: the MoE layers replace fc1/fc2 and
# the activation inside these forwards, legacy DDP must keep skipping `expert` parameters, the
# trainer's gradient sequence (all-reduce, multiply, clip) is what the expert scaling matches.
RELIED_ON = (
    "fairseq.modules.transformer_layer.TransformerEncoderLayerBase.forward",
    "fairseq.modules.transformer_layer.TransformerDecoderLayerBase.forward",
    "fairseq.distributed.legacy_distributed_data_parallel.LegacyDistributedDataParallel.all_reduce_grads",
    "fairseq.trainer.Trainer.train_step",
    "fairseq.distributed.utils.infer_init_method",
    # precision.mark_overflow fills the found-inf record step() reads (hook 13).
    "torch.amp.grad_scaler.GradScaler.step",
)


def _patch(owner, name, wrapper):
    current = getattr(owner, name)
    if not getattr(current, "__wrapped_by_moe_ext__", False):
        ORIGINALS[_qualified(owner, name)] = current
        patched = wrapper(current)
        patched.__wrapped_by_moe_ext__ = True
        setattr(owner, name, patched)


def _qualified(owner, name: str) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{owner.__name__}.{name}"


def _resolve_qualified(qualified: str):
    import importlib

    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(qualified)


def source_fingerprints():
    """sha256 of the source of every hooked or relied-on fairseq function, by qualified name."""
    import hashlib
    import inspect

    objects = dict(ORIGINALS)
    objects.update({qualified: _resolve_qualified(qualified) for qualified in RELIED_ON})
    fingerprints = {}
    for name, obj in objects.items():
        target = obj.fget if isinstance(obj, property) else obj
        fingerprints[name] = hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:16]
    return fingerprints


def install() -> None:
    """Install every hook once per process."""
    global _installed
    if _installed:
        return
    import fairseq
    import fairseq.distributed.utils as distributed_utils
    import fairseq.models
    from fairseq import checkpoint_utils, utils
    from fairseq.trainer import Trainer

    from . import precision

    if not fairseq.__version__.startswith(CHECKED_FAIRSEQ_VERSIONS):
        raise ImportError(
            f"fairseq_moe_ext was checked against fairseq {', '.join(CHECKED_FAIRSEQ_VERSIONS)}, found "
            f"{fairseq.__version__}: install ve-fairseq==0.12.3 (see README)"
        )
    _patch(checkpoint_utils, "load_checkpoint_to_cpu", _wrap_load_checkpoint_to_cpu)
    _patch(distributed_utils, "_infer_torch_distributed_launch_init", _wrap_torchrun_init)
    _patch(fairseq.models, "DistributedFairseqModel", _wrap_distributed_model)
    _patch(utils, "clip_grad_norm_", _wrap_clip_grad_norm)
    _patch(checkpoint_utils, "save_checkpoint", _wrap_save_checkpoint)
    _patch(checkpoint_utils, "load_model_ensemble_and_task", _wrap_load_model_ensemble_and_task)
    _patch(Trainer, "state_dict", _wrap_trainer_state_dict)
    _patch(Trainer, "load_checkpoint", _wrap_trainer_load_checkpoint)
    _patch(Trainer, "_prepare_sample", _wrap_prepare_sample)
    _patch(argparse.ArgumentParser, "error", _wrap_argparse_error)
    precision.install(_patch)
    if not getattr(Trainer.checkpoint_suffix.fget, "__wrapped_by_moe_ext__", False):
        ORIGINALS["fairseq.trainer.Trainer.checkpoint_suffix"] = Trainer.checkpoint_suffix
        ORIGINALS["fairseq.trainer.Trainer.should_save_checkpoint_on_current_rank"] = (
            Trainer.should_save_checkpoint_on_current_rank
        )
        Trainer.checkpoint_suffix = _wrap_checkpoint_suffix(Trainer.checkpoint_suffix)
        Trainer.checkpoint_suffix.fget.__wrapped_by_moe_ext__ = True
        Trainer.should_save_checkpoint_on_current_rank = _wrap_should_save(
            Trainer.should_save_checkpoint_on_current_rank
        )
    _installed = True
