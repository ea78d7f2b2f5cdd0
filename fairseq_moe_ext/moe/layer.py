"""The MoE layer: route, dispatch to experts (possibly on other workers), combine.

Dispatch sorts token-slots by expert and gathers them once; combine brings them back once. Cost
is linear in the number of tokens (no dense ``tokens x experts x capacity`` one-hot einsum). In
dropless routing the sort is a permutation, and dispatch and combine are gathers both ways
(``dispatch.py``); the experts run as one autograd node (``expert_ffn.py``).

With an expert-parallel ``group`` of P workers each worker holds ``E / P`` experts (global ids
``group rank * E/P ...``). Slots travel to their expert's worker and back with one all-to-all each
way, with per-rank split sizes, so workers may hold different numbers of tokens. Statistics behind
the losses and the capacity decision are totalled over ``statistics_group`` (by default the same
group; fairseq models pass the whole world, of which the expert-parallel group is one of several
holding the same experts), which makes a W-worker forward equal to one process holding all
experts and the concatenated batch.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ..common.refusal import MoEOptionError
from . import comm
from .balance_bias import BalanceBias
from .balance_scope import UpdateLoad
from .cache import MoEAux, MoEAuxCache, inside_backward
from .capacity import expert_capacity_tensor, slots_within_capacity_of_batch, token_fraction_capacity
from .dispatch import (
    bucket_counts,
    combine_slots,
    dispatch_slots,
    inverse_permutation,
    permute_rows,
    served_slot_rows,
)
from .expert_output_masking import mask_expert_outputs
from .experts import BatchedExperts
from .layer_config import MoELayerConfig
from .losses import balance_loss, z_loss
from .router import TopKRouter
from .second_expert import gates_renormalised_over_served
from .shared_experts import SharedExperts


class MoELayer(nn.Module):
    """``config``: what the layer computes (checked when it was built); ``group``: the expert-parallel
    process group its experts are spread over (None: all local); ``statistics_group``: the workers
    its routing statistics are totalled over (default ``group``); ``cache``: where ``forward``
    records the aux losses under ``name``; ``seed``: the experts' initialisation; ``expert_device="meta"``:
    experts built to be loaded from a checkpoint, in ``expert_dtype`` (nothing allocated until then)."""

    def __init__(
        self,
        config: MoELayerConfig,
        *,
        group=None,
        statistics_group=None,
        cache: Optional[MoEAuxCache] = None,
        name: str = "moe",
        seed: int = 0,
        expert_device=None,
        expert_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if not isinstance(config, MoELayerConfig):
            raise TypeError(
                f"MoELayer takes an MoELayerConfig, got {type(config).__name__}: build one with "
                f"MoELayerConfig(model_dim, hidden_dim, num_experts, ...) or MoELayerConfig.of(...)"
            )
        self.config = config
        parallel = comm.group_size(group)
        num_experts = config.num_experts
        if num_experts % parallel != 0:
            raise MoEOptionError(
                f"{num_experts} experts cannot be split evenly over {parallel} workers: use an expert "
                f"count that is a multiple of the world size (e.g. {parallel * max(1, num_experts // parallel)})"
            )
        self.group = group
        # Routing statistics (balance loss, z-loss, capacity) are those of every worker that routes
        # to these experts or to replicas of them, which can be more than the all-to-all reaches.
        self.statistics_group = group if statistics_group is None else statistics_group
        # P, the expert-parallel group's size (ExpertLayout.parallel_size; its world_size is W).
        self.parallel_size = parallel
        self.num_local_experts = num_experts // parallel
        self.cache = cache
        self.name = name
        self._group_checked = False
        # The most rows this worker's experts computed in one call since rows_received.take_peak
        # last read it: with dropless routing nothing bounds it, and it is what runs a GPU out of memory.
        self.rows_received_peak = 0
        # Called as routing_tally(layer, expert_index, gates) after each evaluation-mode routing, pads
        # already sent to the id num_experts (routing_stats.py's counts; None: nothing is counted).
        self.routing_tally = None
        routing = config.routing
        # Loss-free balancing (balance_bias.py): the layer makes the bias, the router reads it when
        # choosing (its state key stays router.balance_bias.bias); None keeps the routing as it was.
        bias = None if routing.balance_bias_rate is None else BalanceBias(num_experts, routing.balance_bias_rate)
        self.router = TopKRouter(config.model_dim, num_experts, routing, balance_bias=bias)
        # --moe-balance-scope global-batch (balance_scope.py): the update's counts so far; not a buffer, so
        # never saved, broadcast or cast.
        self.update_load = UpdateLoad() if config.balance_scope == "global-batch" else None
        self.experts = BatchedExperts(
            config.model_dim,
            config.hidden_dim,
            self.num_local_experts,
            first_global_id=comm.group_rank(group) * self.num_local_experts,
            activation=config.activation,
            activation_dropout=config.activation_dropout,
            bias=config.bias,
            seed=seed,
            device=expert_device,  # "meta": built to be loaded (experts.py), in expert_dtype
            dtype=expert_dtype,
        )
        for p in self.experts.parameters():
            # The marker stock fairseq already honours (clip_grad_norm_, legacy DDP): this tensor
            # is owned by one worker and must never be broadcast or averaged across workers.
            p.expert = True
        # Always-active experts (shared_experts.py): shared parameters, never marked as experts.
        self.shared_experts = None
        if config.shared_expert_count:
            self.shared_experts = SharedExperts(
                config.model_dim,
                config.shared_hidden_dim,
                config.shared_expert_count,
                activation=config.activation,
                activation_dropout=config.activation_dropout,
                bias=config.bias,
                seed=seed,
            )

    # What the layer computes, read from its config (one place holds each value).
    model_dim = property(lambda self: self.config.model_dim)
    num_experts = property(lambda self: self.config.num_experts)
    k = property(lambda self: self.config.routing.k)
    capacity_factor = property(lambda self: self.config.capacity_factor)
    eval_capacity_factor = property(lambda self: self.config.eval_capacity_factor)
    # Expert Output Masking (NLLB, the nllb branch's moe_layer.py ``tok_dropout``): see _mask_expert_outputs.
    expert_output_masking = property(lambda self: self.config.expert_output_masking)
    # The nllb branch's evaluation capacity ceil(f * S) (capacity.token_fraction_capacity); 0: off.
    eval_capacity_token_fraction = property(lambda self: self.config.eval_capacity_token_fraction)
    # The nllb branch's default: gates renormalised over the slots kept after dropping (second_expert.py).
    normalize_gates_after_dropping = property(lambda self: self.config.routing.normalize_gates_after_dropping)

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x``: ``[..., model_dim]``; ``padding_mask``: ``x.shape[:-1]``, True at pad tokens.
        Pad tokens are neither routed nor counted, and their output is zero."""
        y, aux = self.forward_with_aux(x, padding_mask)
        if self.cache is not None:
            self.cache.record(self.name, aux)
        return y

    def forward_with_aux(
        self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, MoEAux]:
        if x.dim() < 2 or x.shape[-1] != self.model_dim:
            raise ValueError(f"MoE layer expects input of shape [..., {self.model_dim}], got {tuple(x.shape)}")
        flat = x.reshape(-1, self.model_dim)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        if padding_mask is None:
            y, aux = self.route_tokens(flat)
            return _plus(y.view_as(x), shared), aux
        if tuple(padding_mask.shape) != tuple(x.shape[:-1]):
            raise ValueError(
                f"padding_mask shape {tuple(padding_mask.shape)} does not match the input's token "
                f"shape {tuple(x.shape[:-1])}: pass a boolean mask, True at pad tokens"
            )
        # Pad tokens stay in place (selecting the real ones would read their number on the host):
        # their slots go to no expert and they are left out of every statistic.
        y, aux = self.route_tokens(flat, real=~padding_mask.reshape(-1).bool())
        return _plus(y.view_as(x), shared), aux

    def route_tokens(self, tokens: torch.Tensor, real: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, MoEAux]:
        """The MoE function on ``[N, model_dim]`` tokens; ``real`` (``[N]`` bool, default all) marks
        the tokens that are routed and counted: the others' output is zero.

        One host read per call (``_read_counts``): the rows per expert, which the expert GEMMs and
        the all-to-all need as sizes; everything else stays on the tokens' device (see docs/performance.md,
        "Host syncs: one per layer forward, none in backward")."""
        n, k, num_experts, statistics_group = tokens.shape[0], self.k, self.num_experts, self.statistics_group
        if statistics_group is not None and not self._group_checked:
            # Workers built with different flags would exchange rows of different shapes (at best a
            # transport error, at worst a hang): compare once, before the first exchange.
            comm.check_same_on_every_rank(
                [
                    num_experts,
                    self.num_local_experts,
                    self.parallel_size,
                    comm.group_size(statistics_group),
                    self.model_dim,
                    k,
                ],
                ["experts", "local experts", "expert-parallel size", "world size", "model dim", "top-k"],
                f"MoE layer {self.name}",
                statistics_group,
            )
            self._group_checked = True
        routing = self.router(tokens)
        expert_index = routing.expert_index
        if real is not None:
            # Pad tokens choose the id num_experts, which no expert holds: sorted after every real
            # slot, never dispatched, counted nowhere.
            expert_index = torch.where(real.unsqueeze(1), expert_index, num_experts)
        if self.routing_tally is not None and not self.training:
            self.routing_tally(self, expert_index, routing.gates)

        # Losses from world-wide sums (see comm.all_reduce_sum for why its backward also sums).
        # Counts stay exact integers and sums fp32 (or wider) whatever the router's dtype: with
        # --moe-gating-no-fp32 an fp16 count overflows at 65,504 tokens and bf16 counts 1001 as 1000.
        top1_count = bucket_counts(expert_index[:, 0], num_experts + 1)[:num_experts]
        num_real = top1_count.sum().view(1)
        lse_square = torch.logsumexp(routing.logits.float(), dim=-1).pow(2)
        probs = routing.probs
        if real is not None:
            lse_square = torch.where(real, lse_square, 0.0)
            probs = torch.where(real.unsqueeze(1), probs, 0.0)
        prob_sum = probs.sum(0, dtype=torch.float32)
        # One all-reduce for counts and sums (each collective is a point where the faster worker
        # waits): fp64 holds the int64 counts exactly (below 2^53) and every fp32 sum; with one
        # process the round trip fp32 -> fp64 -> fp32 changes no bit.
        by_fraction = not self.training and self.eval_capacity_token_fraction > 0
        parts = [top1_count.double(), num_real.double(), prob_sum.double(), lse_square.sum().double().view(1)]
        if by_fraction:  # every token position, pads included: the S of the branch's ceil(f * S)
            parts.append(torch.full((1,), float(n), dtype=torch.float64, device=tokens.device))
        totals = comm.all_reduce_sum(torch.cat(parts), statistics_group)
        counts = totals[: num_experts + 1].round().long()
        sums = totals[num_experts + 1 :].float()
        total_tokens = counts[-1]
        load, load_tokens = counts[:num_experts], None
        if self.update_load is not None and self.training:
            load, load_tokens = self.update_load.counted(load, total_tokens, add=not inside_backward())
        aux_balance = balance_loss(sums[:num_experts], load, total_tokens, load_tokens)
        aux_z = z_loss(sums[num_experts], total_tokens)

        capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
        capacity = expert_capacity_tensor(total_tokens, num_experts, k, capacity_factor)
        if by_fraction:
            capacity = token_fraction_capacity(totals[-1].round().long(), self.eval_capacity_token_fraction)
        slot_expert = expert_index.reshape(-1)  # token-major slots (token t, choice j) -> t * k + j
        # The real tokens' choices before capacity: logged, and the load behind the balance bias.
        routed_load = bucket_counts(slot_expert, num_experts + 1)[:num_experts]
        if self.router.balance_bias is not None:
            self.router.balance_bias.observe(routed_load)
        if capacity is not None:
            keep = self._slots_within_capacity(routing, capacity, expert_index)
            slot_expert = torch.where(keep.reshape(-1), slot_expert, num_experts)  # dropped: no expert
        gates = routing.gates
        if self.normalize_gates_after_dropping:
            gates = gates_renormalised_over_served(
                routing.probs, routing.expert_index, (slot_expert < num_experts).view(n, k)
            )

        # Dispatch: slots sorted by expert; unserved ones (pads, dropped) sort last and are cut off.
        order = torch.argsort(slot_expert, stable=True)
        expert_load = routed_load if capacity is None else bucket_counts(slot_expert, num_experts + 1)[:num_experts]
        loads, exchange = self._read_counts(expert_load)
        served = sum(loads)
        self.rows_received_peak = max(self.rows_received_peak, served if exchange is None else sum(exchange[1]))
        if served == n * k:
            # Dropless: sorting is a permutation of all slots, so both directions are gathers.
            slot_row = inverse_permutation(order)
            dispatched = dispatch_slots(tokens, order, slot_row, k)
            expert_out = self._mask_expert_outputs(self._run_experts(dispatched, loads, expert_load, exchange))
            y = combine_slots(expert_out, gates, order, slot_row)
        else:
            sorted_slots = order[:served]
            slot_row = served_slot_rows(sorted_slots, n * k)  # unserved slots: row `served`, past the end
            dispatched = dispatch_slots(tokens, sorted_slots, slot_row, k)
            expert_out = self._mask_expert_outputs(self._run_experts(dispatched, loads, expert_load, exchange))
            if served == 0:  # nothing routed here (only padding: fairseq's dummy batch)
                # Zeros that still depend on expert_out: its backward is this rank's share of the
                # all-to-all backward, which every rank must issue.
                y = expert_out.new_zeros(n, self.model_dim) + expert_out.sum()
            else:
                # Combine as in the dropless path, with unserved slots (dropped, pads) reading any
                # served row (row 0) at gate exactly 0: their term adds exactly zero.
                served_mask = slot_expert < num_experts
                slot_row = torch.where(served_mask, slot_row, 0)
                gates = gates * served_mask.view(n, k)
                y = combine_slots(expert_out, gates, sorted_slots, slot_row)
        # Statistics for the logs stay on the device; the criterion reads all layers' at once.
        probs = probs.detach()
        num_slots = num_real.squeeze(0) * k
        stats = {
            "num_tokens": num_real.squeeze(0).float(),
            "num_slots": num_slots.float(),
            "dropped_slots": (num_slots - expert_load.sum()).float(),
            "expert_slots": routed_load.float(),
            # In fp32 whatever the router's dtype: pads' (and underflowed) probabilities are 0, and
            # 0 * log(0) must count 0 (xlogy), not NaN as with fp16's clamp_min(1e-20) == 0.
            "router_entropy_sum": -torch.special.xlogy(probs.float(), probs.float()).sum(),
        }
        return y, MoEAux(aux_balance, aux_z, stats)

    def _mask_expert_outputs(self, expert_out: torch.Tensor) -> torch.Tensor:
        return mask_expert_outputs(expert_out, self.expert_output_masking, self.training)

    def _slots_within_capacity(self, routing, capacity, expert_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``expert_index`` (default the router's) may send pad slots to the id ``num_experts``."""
        expert_index = routing.expert_index if expert_index is None else expert_index
        score, group = routing.priority_score, self.statistics_group
        return slots_within_capacity_of_batch(expert_index, self.num_experts, capacity, score, group)

    def _read_counts(self, expert_load: torch.Tensor) -> Tuple[List[int], Optional[Tuple[torch.Tensor, List[int]]]]:
        """The layer's one host read per forward: rows per (global) expert sent from here, and with
        expert parallelism the rows each rank sends to this one's experts, ``[P, L]`` (exchanged
        on the device first), as one ``tolist`` of their concatenation."""
        if self.group is None:
            return expert_load.tolist(), None
        recv_counts = comm.exchange_counts(expert_load.view(self.parallel_size, self.num_local_experts), self.group)
        both = torch.cat([expert_load, recv_counts.reshape(-1)]).tolist()
        return both[: self.num_experts], (recv_counts, both[self.num_experts :])

    def _run_experts(self, dispatched, loads: List[int], expert_load: torch.Tensor, exchange) -> torch.Tensor:
        if self.group is None:
            return self.experts(dispatched, loads, expert_load)
        parallel, local = self.parallel_size, self.num_local_experts
        recv_counts, recv_flat = exchange  # [source rank, local expert], on the device and the host
        send_splits = [sum(loads[r * local : (r + 1) * local]) for r in range(parallel)]
        recv_splits = [sum(recv_flat[r * local : (r + 1) * local]) for r in range(parallel)]
        received = comm.all_to_all(dispatched, send_splits, recv_splits, self.group)
        # Rows arrive grouped by source rank; experts want them grouped by local expert.
        row_expert = torch.repeat_interleave(
            torch.arange(local, device=received.device).repeat(parallel),
            recv_counts.reshape(-1).to(received.device),
            output_size=received.shape[0],
        )
        by_expert = torch.argsort(row_expert, stable=True)
        from_expert = inverse_permutation(by_expert)
        local_counts = [sum(recv_flat[i::local]) for i in range(local)]
        out = self.experts(permute_rows(received, by_expert, from_expert), local_counts, recv_counts.sum(0))
        out = permute_rows(out, from_expert, by_expert)
        return comm.all_to_all(out, recv_splits, send_splits, self.group)

    def extra_repr(self):
        return (
            f"experts={self.num_experts} (local {self.num_local_experts}), k={self.k}, "
            f"capacity_factor={self.capacity_factor}, eval_capacity_factor={self.eval_capacity_factor}"
        )


def _plus(routed: torch.Tensor, shared: Optional[torch.Tensor]) -> torch.Tensor:
    return routed if shared is None else routed + shared
