from . import distillation, moe_criterions  # noqa: F401  (registers moe_distillation and the MoE criterions)
