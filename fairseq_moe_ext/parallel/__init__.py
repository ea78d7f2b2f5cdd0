"""Parallelism around the MoE model: the tier between the models and fairseq's data-parallel wrappers.

Torch and fairseq's distributed helpers only; no model, no criterion. Each module one subject:

* ``process_state.py``: the plugin's process-wide state, one object (each field names its writer and reader).
* ``plan.py``: ``ParallelPlan``, how a model is spread over its workers (W, P, rank, backend, experts whole or
  sharded, FSDP unit, timeout), decided once when the model is built and kept on it; the expert-parallel,
  replica and statistics groups made from it.
* ``expert_grads.py``: expert-aware data parallelism: expert gradients summed over their replicas and
  scaled, shared parameters checked equal before training, the supported backends.
* ``grad_norm.py``: the gradient norm under every backend (the single-process norm on every worker).
* ``fully_sharded.py``: ``--ddp-backend fully_sharded`` on torch FSDP2: the shared part sharded per layer,
  experts left out, state gathered one tensor at a time.
* ``expert_sharding.py``: ``--moe-fully-sharded-experts sharded``: each MoE layer's experts an FSDP2 unit over
  their replica group.
* ``sharded_training.py``: the one route from a built model to the FSDP2-wrapped one under fully_sharded, as
  its plan says (experts over their replicas first, then the shared part).
* ``io_waits.py``: where workers wait for another worker's checkpoint file work (gloo, hours).

Importing this package imports none of them (``process_state`` stays importable without fairseq).
"""
