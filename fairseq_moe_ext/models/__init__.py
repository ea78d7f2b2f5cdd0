from . import moe_transformer  # noqa: F401  (registers moe_transformer, moe_transformer_lm and their sizes)
