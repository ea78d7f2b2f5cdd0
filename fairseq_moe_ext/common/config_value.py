"""The one reader of configuration values, for every kind of config the plugin is handed: an
argparse Namespace (fairseq's args, old checkpoints' ``args``), an omegaconf section (fairseq's cfg,
the models' dataclass config), a plain dict (a checkpoint's saved ``cfg``), or None (a checkpoint
without that section). In the bottom tier, ``common/``: the checkpoint tools read saved
ones without fairseq; ``models/``, ``training/`` and the fairseq hooks read the live ones through it.
"""


def config_value(cfg, name: str, default=None):
    """``cfg``'s value of ``name``, or ``default`` where ``cfg`` is None or has no such key (a value
    of None is returned as None: callers that treat it as unset say so)."""
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    # getattr's default also covers omegaconf's missing keys (ConfigAttributeError is an AttributeError).
    return getattr(cfg, name, default)
