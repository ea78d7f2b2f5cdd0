"""Which layers of an encoder or decoder are MoE layers: every ``freq``-th one.

Layer i (0-based) is an MoE layer when (i + 1) is a multiple of the frequency, so frequency 2 makes
layers 1, 3, 5, ... MoE and keeps the dense FFN elsewhere; frequency 0 places none. Each side may
have its own frequency (``--encoder-moe-freq`` / ``--decoder-moe-freq``); without it the side
follows the shared one (``--moe-freq``). Models, the upcycling of dense checkpoints and the resume
checks all place layers with these functions, so the three never disagree.
"""

from typing import List, Optional


def side_moe_freq(shared_freq: int, side_freq: Optional[int]) -> int:
    """The frequency of one side: its own if given (not None), else the shared one."""
    return shared_freq if side_freq is None else side_freq


def is_moe_layer(index: int, freq: int) -> bool:
    return freq > 0 and (index + 1) % freq == 0


def moe_layer_indices(num_layers: int, freq: int) -> List[int]:
    """The indices of the MoE layers among ``num_layers`` layers."""
    return [i for i in range(num_layers) if is_moe_layer(i, freq)]


def places_moe_layer(num_layers: int, freq: int) -> bool:
    """Whether ``freq`` makes at least one of ``num_layers`` layers an MoE layer."""
    return freq > 0 and num_layers >= freq
