"""Parallelism around the MoE model: the tier between the models and fairseq's data-parallel wrappers.

Torch and fairseq's distributed helpers only; no model, no criterion. Each module one subject:

* ``process_state.py``: the plugin's process-wide state, one object (each field names its writer and reader).
* ``expert_groups.py``: the process's expert layout (W, P, rank) and the expert-parallel, replica and
  statistics groups made from it.
* ``expert_grads.py``: expert-aware data parallelism: expert gradients summed over their replicas and
  scaled, shared parameters checked equal before training, the supported backends.
* ``grad_norm.py``: the gradient norm under every backend (the single-process norm on every worker).
* ``fully_sharded.py``: ``--ddp-backend fully_sharded`` on torch FSDP2: the shared part sharded per layer,
  experts left out, state gathered one tensor at a time.
* ``expert_sharding.py``: ``--moe-fully-sharded-experts sharded``: each MoE layer's experts an FSDP2 unit over
  their replica group.
* ``io_waits.py``: where workers wait for another worker's checkpoint file work (gloo, hours).

Importing this package imports none of them (``process_state`` stays importable without fairseq).
"""
