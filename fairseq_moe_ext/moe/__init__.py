"""MoE math with no fairseq dependency: router, capacity, dispatch, experts, losses, cache."""

from .cache import MoEAux, MoEAuxCache, MoERecord, UncollectedMoELossError
from .capacity import expert_capacity, slots_within_capacity
from .collective_device import MoECollectiveDeviceError, collective_device
from .experts import BatchedExperts, expert_seed
from .layer import MoELayer
from .layer_config import MoELayerConfig, RoutingConfig
from .losses import balance_loss, z_loss
from .router import ROUTER_TYPES, Routing, TopKRouter

# fmt: off
__all__ = [
    "BatchedExperts", "MoEAux", "MoEAuxCache", "MoECollectiveDeviceError", "MoELayer", "MoELayerConfig",
    "MoERecord", "ROUTER_TYPES", "Routing", "RoutingConfig", "TopKRouter", "UncollectedMoELossError",
    "balance_loss", "collective_device", "expert_capacity", "expert_seed", "slots_within_capacity", "z_loss",
]
# fmt: on
