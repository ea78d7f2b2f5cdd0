"""Parallelism around the MoE model: the tier between the models and fairseq's data-parallel wrappers.

Torch and fairseq's distributed helpers only; no model, no criterion. Each module one subject:

* ``process_state.py``: the plugin's process-wide state, one object (each field names its writer and reader).
* ``distributed.py``: expert-aware data parallelism: the expert-parallel, replica and statistics groups, the
  global gradient norm, expert gradients summed over their replicas and scaled.
* ``fully_sharded.py``: ``--ddp-backend fully_sharded`` on torch FSDP2: the shared part sharded per layer,
  experts left out, state gathered one tensor at a time.
* ``expert_sharding.py``: ``--moe-fully-sharded-experts sharded``: each MoE layer's experts an FSDP2 unit over
  their replica group.
* ``io_waits.py``: where workers wait for another worker's checkpoint file work (gloo, hours).

Importing this package imports none of them (``process_state`` stays importable without fairseq).
"""
