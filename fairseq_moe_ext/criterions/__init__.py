from . import moe_criterions  # noqa: F401  (registers moe_cross_entropy, moe_label_smoothed_cross_entropy)
