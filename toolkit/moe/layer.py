"""The expert-parallel Mixture-of-Experts layer: gate -> dispatch (all-to-all) -> experts -> combine.

E experts are split over the W ranks of a group; every rank routes its own tokens. One forward, in
the order a lecture tells it, one method per step:

    1. route                 the gate picks k experts per token; capacity decides what is dropped
                             (dropless: all-reduce MAX of the capacity so every rank agrees on it)
    2. exchange_counts       all-to-all of per-expert token counts: now every rank knows how many
                             rows it will receive from whom, so the next all-to-all can be uneven
    3. sort_by_destination   kept (token, choice) pairs in order of expert, so of destination rank
    4. dispatch              all-to-all with uneven splits: the rows travel to their experts
    5. compute_experts       each local expert runs on the rows it received
    6. combine               all-to-all back, with the splits swapped
    7. weighted_sum          each token adds its experts' answers times the gate weights; a dropped
                             choice adds nothing (the residual connection around the layer carries it)

Steps 4-6 are one method, ``dispatch_compute_combine(rows, plan)``: rows sorted by destination in,
their expert outputs in the same order out. That contract is where issue 6 plugs in: Tutel's
pipelined all-to-all (``pipeline_degree``) and FasterMoE's smart schedule (``schedule="smart"``) are
other implementations of this one step; shadowing (``shadow=``) changes the plan of step 2 (some
experts' rows stay home) and step 5 (those experts run locally on a broadcast copy); the topology
gate (``gate="topology"``) is another step 1; Tutel's data parallelism for the expert weights
(``expert_parallel="dp"``, or "auto" per forward) replaces steps 2-6: every rank uses every expert
and the weights travel instead of the rows. None of them changes the mathematics (the topology gate
changes the routing, by design).

Only kept rows travel (uneven splits), so ranks with different numbers of tokens, hence different
capacities, still agree on every all-to-all; a padded (E, C, d) layout, as Tutel's pipelining splits
along C, needs one capacity for all: the all-reduce MAX that dropless mode already does.

Backward flows through both all-to-alls: ``all_to_all`` (exchange.py) is an autograd function whose
backward is the same all-to-all with the splits swapped (gradients return to where rows came from).
Every collective goes through ``toolkit.comm``, so the trace shows count exchange, dispatch and
combine, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..trace.events import recorder, span
from . import machine
from .capacity import agreed_capacity, capacity
from .exchange import all_to_all, exchange
from .experts import Experts, expert_generator
from .gates import Routing
from .load import enclosing_step, record_load
from .options import check_layer, check_sliceable, check_systems_options, check_tokens, expert_parallel_ranks
from .placement import Placement, ffn
from .plan import Plan
from .shadow_layer import Shadowing
from .sharded import Slicing
from .topology import TopologyGate, make_gate


class MoE(nn.Module):
    """Expert-parallel Mixture-of-Experts: ``forward(x (..., d_model)) -> (output, aux_loss)``.

    The ``num_experts`` experts are split evenly over ``group`` (default: the whole world; without a
    process group one process holds them all). Every rank feeds its own tokens; capacity is per rank
    (GShard's groups), C = ceil(top_k * capacity_factor * T_local / E). ``aux_loss`` is the gate's
    load-balancing loss (+ z-loss) on this rank's tokens: add it, weighted, to the training loss.
    Expert weights depend only on (seed, global expert index); the router on the seed.

    Options: ``dropless`` (never drop; ranks agree on the capacity with an all-reduce MAX),
    ``dynamic_capacity`` (Tutel's adaptive capacity: each step the fullest expert's load, at most
    ``capacity_factor``'s C, agreed like dropless; Tutel spells it capacity_factor=-f), ``noisy``
    / ``noise_std``, ``z_loss_weight``, ``aux_loss`` ("gshard" | "switch"), ``min_capacity`` (see
    ``TopKGate``), ``init_std`` (normal init of router and expert weights), ``name`` (metric key).
    Issue 6's systems options (none changes the mathematics, except the topology gate's routing):
    ``shadow`` "off" | "auto" | [expert ids] (FasterMoE shadowing, ``moe/shadow.py``; ``compute_flops``
    and ``bandwidth`` override the measured or emulated P and W_net of its predictor);
    ``gate`` "topk" | "topology" (FasterMoE's topology-aware gate; ``node_size``, ``bandwidth``,
    ``local_bandwidth`` or the emulated link give its nodes and links); ``expert_parallel``
    "ep" | "dp" | "auto" (Tutel's switchable parallelism for the expert weights, ``moe/placement.py``);
    ``schedule`` "plain" | "smart" (FasterMoE's per-peer steps, ``moe/schedule.py``; ``smart_group_size``
    ranks per step, default 1) or
    ``pipeline_degree`` 1 | d | "auto" (Tutel's chunks along the capacity, ``moe/pipeline.py``): steps
    4-6 overlapped with the experts, one or the other. Tutel, issue 15: ``all_to_all_algorithm``
    "flat" | "2dh" (the two-level all-to-all over nodes of ``node_size`` ranks, ``comm/hierarchical.py``) |
    "auto" (the faster of the two per forward: the emulated link's model, else Tutel's rule of scale);
    more ranks than experts slices each expert over W/E ranks, ``expert_slices`` = Tutel's r
    (``moe/sharded.py``).

    Each forward records ``moe/{name}/load`` on this rank (see ``record_load``).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        *,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        group=None,
        shadow="off",
        pipeline_degree=1,
        schedule: str = "plain",
        gate: str = "topk",
        seed: int = 0,
        dropless: bool = False,
        noisy: bool = False,
        noise_std: float = 1.0,
        z_loss_weight: float = 0.0,
        aux_loss: str = "gshard",
        min_capacity: int = 1,
        init_std: float = 0.02,
        name: str = "moe",
        expert_parallel: str = "ep",
        node_size=None,
        compute_flops=None,
        bandwidth=None,
        local_bandwidth=None,
        smart_group_size: int = 1,
        expert_slices=None,
        all_to_all_algorithm: str = "flat",
        dynamic_capacity: bool = False,
    ):
        super().__init__()
        check_systems_options(
            shadow,
            pipeline_degree,
            schedule,
            gate,
            expert_parallel,
            node_size,
            local_bandwidth,
            smart_group_size,
            all_to_all_algorithm,
        )
        self.group, self.name = group, str(name)
        self.world, self.rank = expert_parallel_ranks(group, dist.is_initialized())
        check_layer(d_model, d_ff, num_experts, self.world, expert_slices, smart_group_size, dropless, dynamic_capacity)
        self.slicing = None  # W > E: moe/sharded.py
        if self.world > num_experts:
            check_sliceable(shadow, schedule, pipeline_degree, gate)
            self.slicing = Slicing(self.world, num_experts, d_ff, expert_slices)
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.num_local, self.dropless, self.seed = max(1, num_experts // self.world), bool(dropless), seed
        self.dynamic_capacity = bool(dynamic_capacity)
        gate_options = dict(
            noisy=noisy,
            noise_std=noise_std,
            dropless=dropless or self.dynamic_capacity,
            z_loss_weight=z_loss_weight,
            aux_loss=aux_loss,
            min_capacity=min_capacity,
        )
        self.gate = make_gate(  # "topk", or FasterMoE's topology-aware gate (moe/topology.py)
            gate,
            d_model,
            num_experts,
            top_k,
            capacity_factor,
            world=self.world,
            rank=self.rank,
            nodes=dict(node_size=node_size, bandwidth=bandwidth, local_bandwidth=local_bandwidth),
            **gate_options,
        )
        self.placement = Placement(expert_parallel)  # Tutel: expert weights used on their owners or everywhere
        self.shadowing = None  # FasterMoE: some experts computed at home (moe/shadow_layer.py)
        if shadow != "off":
            self.shadowing = Shadowing(shadow, num_experts, compute_flops=compute_flops, bandwidth=bandwidth)
        with torch.no_grad():  # the router is the same on every rank and layout: seeded by `seed` alone
            g = expert_generator(seed, -1)
            self.gate.router.weight.copy_(torch.randn(num_experts, d_model, generator=g) * init_std)
        s = self.slicing.s if self.slicing else 1  # W > E: rank r holds slice r % s of expert r // s
        self.experts = Experts(
            d_model,
            d_ff,
            num_experts,
            self.rank * self.num_local // s,
            self.num_local,
            seed=seed,
            init_std=init_std,
            group=group,
            shard=(self.rank % s, s),
        )
        self.calls = 0
        self.schedule, self.pipeline_degree = schedule, pipeline_degree  # steps 4-6: moe/schedule.py, pipeline.py
        self.smart_group_size = smart_group_size
        self.all_to_all_algorithm = all_to_all_algorithm  # Tutel's 2DH over nodes of node_size ranks
        self.node_size = machine.all_to_all_node_size(self.world, all_to_all_algorithm, node_size)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, expert-parallel over {self.world} rank(s), {self.num_local} local expert(s)"

    # --- the forward, step by step ------------------------------------------------------------
    def forward(self, x: torch.Tensor):
        check_tokens(x, self.d_model, self.gate.router.weight.dtype, self.name)
        tokens = x.reshape(-1, self.d_model)
        routing = self.route(tokens)  # 1
        return self.routed(tokens, routing).reshape(x.shape), routing.loss

    def routed(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Steps 2-7 for the gate's decision: every token through its experts and back, weighted. (A layer that
        takes another gate's decision, a Hugging Face model's in moe/hf.py, starts here.)"""
        if self.placement.replicate(self, routing):  # 2-6 data-parallel (moe/placement.py)
            plan, order, answers = self.placement.forward(self, tokens, routing)
        elif self.shadowing is not None:  # 2-6, shadowed experts at home (moe/shadow_layer.py)
            plan, order, answers = self.shadowing.forward(self, tokens, routing)
        else:
            plan = self.exchange_counts(routing)  # 2
            order, rows = self.sort_by_destination(tokens, routing)  # 3
            answers = self.dispatch_compute_combine(rows, plan)  # 4, 5, 6
        out = self.weighted_sum(answers, routing, order, tokens)  # 7
        self.record_load(routing, plan)
        return out

    def route(self, tokens: torch.Tensor) -> Routing:
        """Step 1: the gate's decision; in dropless mode, the capacity every rank agrees on. Dynamic
        capacity (Tutel): this step's capacity is the fullest expert's load, at most what
        ``capacity_factor`` allows, agreed by all ranks like dropless."""
        routing = self.gate(tokens)
        if self.dynamic_capacity:
            bound = capacity(
                routing.num_tokens, self.num_experts, self.top_k, self.gate.capacity_factor, self.gate.min_capacity
            )
            routing = routing.with_capacity(min(routing.capacity, bound))
        if (self.dropless or self.dynamic_capacity) and dist.is_initialized():
            routing = routing.with_capacity(agreed_capacity(routing.capacity, self.group, routing.counts.device))
        return routing

    def exchange_counts(self, routing: Routing) -> Plan:
        """Step 2: tell every rank how many rows it gets for each of its experts (all-to-all of counts)."""
        send = (
            self.slicing.send_counts(routing.kept_counts)
            if self.slicing
            else routing.kept_counts.reshape(self.world, self.num_local)
        )
        split = [self.num_local] * self.world
        recv = exchange(send.reshape(-1), split, split, self.group, "counts")
        return Plan(send, recv.reshape(self.world, self.num_local))

    def sort_by_destination(self, tokens: torch.Tensor, routing: Routing):
        """Step 3: kept (token, choice) pairs ordered by expert, then slot; experts are contiguous per
        rank, so this is also destination-rank order. Returns (choice ids into the flat (T*k), rows)."""
        place = routing.buffer_index().reshape(-1)  # expert * C + slot, -1 when dropped
        kept = (place >= 0).nonzero().squeeze(1)
        order = kept[place[kept].argsort()]  # unique keys: the order is deterministic
        return order, tokens[order // routing.top_k]

    def dispatch_compute_combine(self, rows: torch.Tensor, plan: Plan, wrap=None) -> torch.Tensor:
        """Steps 4-6: rows to their experts' ranks, through the experts, and back in the same order.
        ``schedule="smart"``: per-peer steps (moe/schedule.py); ``pipeline_degree``: chunks (moe/pipeline.py).
        ``wrap``: shadowing puts its rows kept home around whichever pattern runs (moe/shadow_steps.py)."""
        from .units import WholeExchange, overlapped

        if dist.is_initialized() and self.world > 1 and (self.schedule == "smart" or self.pipeline_degree != 1):
            from .pipeline import pipelined_dispatch_compute_combine
            from .schedule import smart_dispatch_compute_combine

            overlap = smart_dispatch_compute_combine if self.schedule == "smart" else pipelined_dispatch_compute_combine
            return overlap(self, rows, plan, wrap)
        if wrap is not None:
            return overlapped(wrap(WholeExchange(self, plan)), rows, self)
        copies = self.slicing.copies(plan) if self.slicing else None  # W > E: one copy per slice group
        if copies is not None:
            kept, rows = rows.shape[0], rows[copies]
        nodes = self.node_size if self.all_to_all_algorithm == "2dh" else machine.all_to_all_nodes(self, rows)
        received = all_to_all(rows, plan.recv_splits, plan.send_splits, self.group, "dispatch", nodes)
        outputs = self.compute_experts(received, plan)
        answers = all_to_all(outputs, plan.send_splits, plan.recv_splits, self.group, "combine", nodes)
        if copies is not None:  # the slices' partial outputs, added up
            answers = answers.new_zeros((kept,) + tuple(answers.shape[1:])).index_add(
                0, copies.to(answers.device), answers
            )
        return answers

    def compute_experts(self, received: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Step 5: rows arrive grouped by sender, then local expert; regroup by expert, run, put back."""
        W, E_local = plan.recv_counts.shape
        expert_of_row = torch.arange(E_local, device=plan.recv_counts.device).repeat(W)
        expert_of_row = expert_of_row.repeat_interleave(plan.recv_counts.reshape(-1))
        by_expert = expert_of_row.argsort(stable=True)
        with span(f"moe/{self.name}/experts", rows=received.shape[0]):
            if self.slicing is not None:  # one slice of one expert (moe/sharded.py)
                return ffn(received, *self.slicing.weights(self))
            out = self.experts(received[by_expert], plan.expert_rows)
        return out[by_expert.argsort()]

    def weighted_sum(self, answers, routing: Routing, order, tokens) -> torch.Tensor:
        """Step 7: out[t] = sum over t's kept choices of gate_weight * expert output (differentiable)."""
        weight = routing.gate_weight.reshape(-1)[order].to(answers.dtype)
        out = answers.new_zeros(tokens.shape)
        return out.index_add(0, (order // routing.top_k).to(out.device), answers * weight[:, None])

    # --- what the Run learns ------------------------------------------------------------------
    def record_load(self, routing: Routing, plan: Plan) -> None:
        """Record ``moe/{name}/load`` on this rank, one per forward (moe/load.py's ``record_load`` says
        what it holds; ``merge_load`` there sums the ranks' views)."""
        self.calls += 1
        if isinstance(self.gate, TopologyGate) and recorder.enabled:  # rows that cross nodes, wanted and sent, and L
            recorder.metric(f"moe/{self.name}/topology", self.gate.record(routing), step=enclosing_step())
        record_load(self, routing, plan)
