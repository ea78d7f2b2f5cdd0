"""The bottom tier: helpers every tier above uses and that belong to none of their subjects.

``config_value.py`` reads a value from any kind of config (Namespace, omegaconf, dict, None);
``torch_compat.py`` holds the private torch APIs of data parallelism (GradScaler's per-optimizer
state, torch DDP's ignore list, ``_foreach_mul_``), each behind a fallback or a one-line message;
``refusal.py`` the one exception type of input the plugin refuses (``MoERefusal``), which every tier raises
and the fairseq tools print as one ``prog: error:`` line.
Torch only; imports nothing else of the package (tests/repo/test_package_tiers.py).
"""
