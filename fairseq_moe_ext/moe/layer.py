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

``route_tokens`` reads as its steps, each in its own file: the router chooses (``router.py``, given the
layer's balance bias), every worker's counts and sums are exchanged in one all-gather (``batch_totals.py``:
their totals, and what each worker sends to each expert), the router losses (``losses.py``) and the capacity
(``capacity.py``) follow from them, the bias counts the load (``balance_bias.py``), slots are dispatched to
the experts and combined (``dispatch.through_experts``), and the statistics for the logs are kept
(``routing_log.py``).
"""

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..common.refusal import MoEOptionError
from . import comm
from .balance_bias import BalanceBias
from .balance_scope import UpdateLoad
from .batch_totals import BatchTotals, batch_totals, choice_counts, sent_per_expert
from .cache import MoEAux, MoEAuxCache, inside_backward
from .capacity import (
    expert_capacity_tensor,
    slots_within_capacity_of_batch,
    slots_within_capacity_of_counts,
    token_fraction_capacity,
)
from .dispatch import bucket_counts, through_experts
from .expert_output_masking import mask_expert_outputs
from .experts import BatchedExperts
from .layer_config import MoELayerConfig
from .losses import balance_loss, z_loss
from .remote_experts import rows_per_expert, through_their_workers
from .router import TopKRouter
from .routing_log import routing_log
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
        # The rank in the statistics group of each expert-parallel peer (a slice where they are consecutive).
        self._peers = comm.ranks_within(group, self.statistics_group) if group is not None else None
        # The most rows this worker's experts computed in one call since rows_received.take_peak
        # last read it: with dropless routing nothing bounds it, and it is what runs a GPU out of memory.
        self.rows_received_peak = 0
        # Called as routing_tally(layer, expert_index, gates) after each evaluation-mode routing, pads
        # already sent to the id num_experts (routing_stats.py's counts; None: nothing is counted).
        self.routing_tally = None
        # (LockStep, stack) where a lock-step round rides on this layer's next exchange (lockstep.py), else None.
        self.lockstep_round = None
        routing = config.routing
        # Loss-free balancing (balance_bias.py; None keeps the routing as it was): the layer's own, counted
        # and passed to the router by the layer. The module sits in the router's place of the module tree
        # (held, never read, by it) so that its state key stays router.balance_bias.bias, which sets, the
        # HF and branch mappings, pruning and --moe-freeze name; the layer's handle is not registered.
        bias = None if routing.balance_bias_rate is None else BalanceBias(num_experts, routing.balance_bias_rate)
        self.router = TopKRouter(config.model_dim, num_experts, routing, balance_bias=bias)
        object.__setattr__(self, "balance_bias", bias)
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

    def route_tokens(
        self, tokens: torch.Tensor, real: Optional[torch.Tensor] = None, *, exchanged=None
    ) -> Tuple[torch.Tensor, MoEAux]:
        """The MoE function on ``[N, model_dim]`` tokens; ``real`` (``[N]`` bool, default all) marks
        the tokens that are routed and counted: the others' output is zero. ``exchanged``: the exchange's
        ``(rows, host_counts)`` already made (a lock-step round's, for a mirrored call; lockstep.py).

        One host read per call (``remote_experts.rows_per_expert``): the rows per expert, which the expert GEMMs and
        the all-to-all need as sizes; everything else stays on the tokens' device (see docs/performance.md,
        "Host syncs: one per layer forward, none in backward")."""
        k, num_experts = self.k, self.num_experts
        self._check_group_once()
        routing = self.router(tokens, None if self.balance_bias is None else self.balance_bias.bias)
        expert_index = routing.expert_index
        if real is not None:
            # Pad tokens choose the id num_experts, which no expert holds: sorted after every real
            # slot, never dispatched, counted nowhere.
            expert_index = torch.where(real.unsqueeze(1), expert_index, num_experts)
        if self.routing_tally is not None and not self.training:
            self.routing_tally(self, expert_index, routing.gates)
        # Whoever adds the losses may sum their gradients over the workers once for every layer (cache.py).
        sum_over = self.statistics_group if self.cache is not None and self.cache.collector_sums else None
        exchange = self._lockstep_exchange() if exchanged is None else (lambda row: exchanged)
        totals = batch_totals(routing, expert_index, real, self.statistics_group, sum_over is None, exchange)
        aux_balance, aux_z = self._router_losses(totals)
        capacity = self._capacity(totals)
        # The real tokens' choices before capacity (token-major slots: token t's choice j is slot t * k + j):
        # logged, and the load behind the balance bias.
        routed_load = bucket_counts(expert_index.reshape(-1), num_experts + 1)[:num_experts]
        if self.balance_bias is not None:  # every worker's load, from the exchange
            self.balance_bias.observe(sent_per_expert(totals.rows, num_experts, k).sum(0))
        slot_expert, gates, sent = self._serve_within(capacity, routing, expert_index, totals)
        order = torch.argsort(slot_expert, stable=True)  # slots by expert; unserved ones (pads, dropped) last
        expert_load = routed_load if capacity is None else bucket_counts(slot_expert, num_experts + 1)[:num_experts]
        host_counts = totals.host_counts if capacity is None else None
        loads, exchange = rows_per_expert(
            expert_load, sent, host_counts, self.group, self.statistics_group, self._peers, self.num_local_experts
        )
        served = sum(loads)
        self.rows_received_peak = max(self.rows_received_peak, served if exchange is None else sum(exchange[1]))

        def experts(rows):
            if self.group is None:
                return self._mask_expert_outputs(self.experts(rows, loads, expert_load))
            out = through_their_workers(rows, loads, exchange, self.experts, self.group, self.num_local_experts)
            return self._mask_expert_outputs(out)

        y = through_experts(tokens, order, slot_expert, gates, served, num_experts, experts)
        stats = routing_log(totals.local_tokens, k, expert_load, routed_load, totals.local_probs)
        return y, MoEAux(aux_balance, aux_z, stats, collector_sums_over=sum_over)

    def _lockstep_exchange(self):
        """The exchange of a lock-step round armed on this layer (``LockStep.before``; None: a plain all-gather)."""
        armed, self.lockstep_round = self.lockstep_round, None
        if armed is None:
            return None
        lockstep, stack = armed
        return lambda row: lockstep.exchange(row, stack)

    def _check_group_once(self) -> None:
        """Workers built with different flags would exchange rows of different shapes (at best a transport
        error, at worst a hang): compared once, before the first exchange."""
        if self.statistics_group is None or self._group_checked:
            return
        comm.check_same_on_every_rank(
            [
                self.num_experts,
                self.num_local_experts,
                self.parallel_size,
                comm.group_size(self.statistics_group),
                self.model_dim,
                self.k,
            ],
            ["experts", "local experts", "expert-parallel size", "world size", "model dim", "top-k"],
            f"MoE layer {self.name}",
            self.statistics_group,
        )
        self._group_checked = True

    def _router_losses(self, totals: BatchTotals) -> Tuple[torch.Tensor, torch.Tensor]:
        """(balance loss, z-loss) of the statistics group's batch; with the global-batch scope the balance
        loss's load counts every micro-batch of the update so far (balance_scope.py)."""
        load, load_tokens = totals.first_choices, None
        if self.update_load is not None and self.training:
            load, load_tokens = self.update_load.counted(load, totals.tokens, add=not inside_backward())
        return balance_loss(totals.prob_sum, load, totals.tokens, load_tokens), z_loss(
            totals.lse_square_sum, totals.tokens
        )

    def _capacity(self, totals: BatchTotals) -> Optional[torch.Tensor]:
        """Slots per expert (None: every slot is served), from the statistics group's batch (capacity.py)."""
        if not self.training and self.eval_capacity_token_fraction > 0:  # the nllb branch's evaluation capacity
            return token_fraction_capacity(totals.positions, self.eval_capacity_token_fraction)  # ceil(f * S)
        capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return expert_capacity_tensor(totals.tokens, self.num_experts, self.k, capacity_factor)

    def _serve_within(self, capacity: Optional[torch.Tensor], routing, expert_index: torch.Tensor, totals):
        """(each slot's expert, the id ``num_experts`` for a slot over ``capacity`` or a pad's; the gates; every
        worker's served slots per expert ``[W, E]``, from the exchange): the gates renormalised over the slots kept
        when the layer does so after dropping (second_expert.py)."""
        n, k, num_experts = expert_index.shape[0], self.k, self.num_experts
        slot_expert = expert_index.reshape(-1)
        if capacity is None:
            sent = sent_per_expert(totals.rows, num_experts, k)
        else:
            keep, sent = self._slots_within_capacity(routing, capacity, expert_index, totals)
            slot_expert = torch.where(keep.reshape(-1), slot_expert, num_experts)  # dropped: no expert
        gates = routing.gates
        if self.normalize_gates_after_dropping:
            served = (slot_expert < num_experts).view(n, k)
            gates = gates_renormalised_over_served(routing.probs, routing.expert_index, served)
        return slot_expert, gates, sent

    def _mask_expert_outputs(self, expert_out: torch.Tensor) -> torch.Tensor:
        return mask_expert_outputs(expert_out, self.expert_output_masking, self.training)

    def _slots_within_capacity(self, routing, capacity, expert_index: torch.Tensor, totals: BatchTotals):
        """``(keep [N, k], every worker's served slots per expert [W, E])`` (capacity.py): in batch order from the
        exchanged counts alone; by priority score over the gathered decisions (their sizes read first)."""
        group, num_experts, k = self.statistics_group, self.num_experts, self.k
        score = routing.priority_score
        if score is None:
            counts = choice_counts(totals.rows, num_experts, k)
            return slots_within_capacity_of_counts(expert_index, num_experts, capacity, counts, comm.group_rank(group))
        sizes = totals.rows[:, k * num_experts].round().long().tolist() if group is not None else None
        return slots_within_capacity_of_batch(expert_index, num_experts, capacity, score, group, sizes)

    def extra_repr(self):
        return (
            f"experts={self.num_experts} (local {self.num_local_experts}), k={self.k}, "
            f"capacity_factor={self.capacity_factor}, eval_capacity_factor={self.eval_capacity_factor}"
        )


def _plus(routed: torch.Tensor, shared: Optional[torch.Tensor]) -> torch.Tensor:
    return routed if shared is None else routed + shared
