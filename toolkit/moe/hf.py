"""Expert parallelism for Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE, ...), their gate kept.

A Hugging Face MoE block is a router and an experts module: `experts(tokens, top_k_index, top_k_weights)` runs
E SwiGLU experts held as two fused tensors, `gate_up_proj` (E, 2·d_ff, d) and `down_proj` (E, d, d_ff). The
router (and Qwen-MoE's shared expert) decide and add as before; only that experts module changes, in place
(its class, not its name), into the toolkit's expert-parallel layer (`layer.py`):

    route           the model's own gate chose (top_k_index, top_k_weights); no token is dropped (the capacity is
                    the fullest expert's load, agreed by all ranks, as the layer's dropless mode does)
    2-6             counts, sort, dispatch, this rank's experts, combine: the layer's own steps, so shadowing
                    (`shadow=`), Tutel's pipelined all-to-all (`pipeline_degree=`) and the smart schedule apply
    7               each token adds its experts' answers times the gate's weights
    load            `moe/{name}/load` per forward, as every toolkit MoE layer records (the heatmap draws it)

Rank r of the W ranks of `group` keeps experts r·E/W .. (r+1)·E/W - 1: its slice of each fused tensor, tagged
as expert parameters (data-parallel strategies leave them alone). `full_state_dict` joins the slices, so the
state is keyed and shaped as the Hugging Face model's own and compares with it directly.

    expert_parallel(MixtralForCausalLM(config))                 # experts over the whole world
    expert_parallel(model, group=g, shadow="auto", pipeline_degree=2)
    expert_parallel(model, local=True)                           # every expert here, no collectives: how the
                                                                 # simulator runs a model as it came
On a simulated cluster (meta tensors, `toolkit.moe.gates.assume_routing`) the decision is the assumed one,
as for every toolkit MoE layer: the routing is data, which meta tensors do not have, so it is priced from
the shapes (each expert's rows) instead of run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..trace.events import span
from . import gates
from .capacity import agreed_capacity
from .layer import MoE
from .options import check_systems_options, expert_parallel_ranks
from .placement import Placement, run_experts
from .plan import Plan
from .routing import Routing, _slots
from .shadow_layer import Shadowing

OPTIONS = (
    "shadow",
    "pipeline_degree",
    "schedule",
    "smart_group_size",
    "all_to_all_algorithm",
    "node_size",
    "compute_flops",
    "bandwidth",
)


def is_hf_experts(module: nn.Module) -> bool:
    """A Hugging Face fused experts module: 3-D `gate_up_proj` and `down_proj`, and `num_experts`."""
    weights = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    return all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights) and isinstance(
        getattr(module, "num_experts", None), int
    )


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if is_hf_experts(m)]


def expert_parallel(model: nn.Module, group=None, *, local: bool = False, **options) -> nn.Module:
    """Every Hugging Face experts module of `model` made expert-parallel over `group` (default: the world), in
    place; `options` are the MoE layer's systems options (OPTIONS). Returns the model."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"expert_parallel: unknown option(s) {sorted(unknown)}; valid: {list(OPTIONS)}.")
    found = find_experts(model)
    if not found:
        raise ValueError(
            f"expert_parallel: {type(model).__name__} has no Hugging Face experts module (one holding "
            f"3-D gate_up_proj and down_proj, as Mixtral's and Qwen2-MoE's do). For the toolkit's own "
            f"layer build the model with toolkit.models.moe_gpt."
        )
    for name, module in found:
        if not isinstance(module, ExpertParallelExperts):
            module.__class__ = type(f"ExpertParallel{type(module).__name__}", (ExpertParallelExperts, type(module)), {})
        module.setup(name, group, local, **options)
    return model


class ExpertParallelExperts(MoE):
    """Mixed into a Hugging Face experts module's class: its forward becomes the toolkit layer's steps."""

    @property
    def experts(self):  # the layer's steps (and shadowing) reach the expert weights as `layer.experts`
        return self

    @torch.no_grad()
    def setup(
        self,
        name: str,
        group,
        local: bool,
        shadow="off",
        pipeline_degree=1,
        schedule="plain",
        smart_group_size=1,
        all_to_all_algorithm="flat",
        node_size=None,
        compute_flops=None,
        bandwidth=None,
    ):
        if getattr(self, "has_bias", False) or not getattr(self, "has_gate", True):
            raise ValueError(
                f"expert_parallel: {name} has biases or no gate projection; the toolkit's layer runs "
                f"gated experts without biases (Mixtral's, Qwen2-MoE's)."
            )
        check_systems_options(
            shadow, pipeline_degree, schedule, "topk", "ep", node_size, None, smart_group_size, all_to_all_algorithm
        )
        distributed = dist.is_initialized() and not local
        E = self.num_experts
        self.group, self.name = group, name
        self.world, self.rank = expert_parallel_ranks(group, distributed)
        if E % self.world:
            fits = [w for w in range(1, E + 1) if E % w == 0]
            raise ValueError(
                f"expert_parallel: {E} experts of {name} do not split over {self.world} ranks; use an "
                f"expert-parallel group whose size divides {E} (one of {fits})."
            )
        self.num_local, self.first = E // self.world, self.rank * (E // self.world)
        gate_up = self.gate_up_proj
        self.d_model = gate_up.shape[-1] if not getattr(self, "is_transposed", False) else gate_up.shape[1]
        self.d_ff = self.down_proj.shape[-1] if not getattr(self, "is_transposed", False) else self.down_proj.shape[1]
        self.top_k, self.slicing, self.gate, self.dropless, self.dynamic_capacity = None, None, None, True, False
        self.placement, self.calls = Placement("ep"), 0
        self.shadowing = (
            None if shadow == "off" else Shadowing(shadow, E, compute_flops=compute_flops, bandwidth=bandwidth)
        )
        self.schedule, self.pipeline_degree, self.smart_group_size = schedule, pipeline_degree, smart_group_size
        self.all_to_all_algorithm, self.node_size = all_to_all_algorithm, node_size
        if self.world > 1:  # keep this rank's experts only
            for attr in ("gate_up_proj", "down_proj"):
                full = getattr(self, attr)
                mine = nn.Parameter(
                    full[self.first : self.first + self.num_local].clone(), requires_grad=full.requires_grad
                )
                mine._toolkit_expert = True
                setattr(self, attr, mine)

    @property
    def row_flops(self) -> int:
        """FLOPs of one row through one expert's forward: three GEMMs (gate, up, down)."""
        return 6 * self.d_model * self.d_ff

    @property
    def all_expert_params(self) -> int:
        return self.num_experts * 3 * self.d_model * self.d_ff

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        routing = self.route_given(hidden_states, top_k_index, top_k_weights)  # 1: the model's gate chose
        return self.routed(hidden_states, routing).to(hidden_states.dtype)  # 2-7: the layer's own steps

    def route_given(self, tokens, top_k_index, top_k_weights) -> Routing:
        """The gate's decision as a Routing, dropless: the capacity is the fullest expert's load over the group."""
        T, k = top_k_index.shape
        if gates._assumed is not None:  # a simulated rank (meta tokens) or a what-if: the assumed decision
            top_k_index = gates._assumed(T, self.num_experts, k)
        self.top_k = k
        slot, counts = _slots(top_k_index, self.num_experts)
        cap = max(int(counts.max()) if T else 0, 1)
        if dist.is_initialized() and self.world > 1:
            cap = agreed_capacity(cap, self.group, counts.device)
        return Routing(
            expert_index=top_k_index,
            gate_weight=top_k_weights,
            slot=slot,
            kept=slot < cap,
            counts=counts,
            kept_counts=counts.clamp(max=cap),
            capacity=cap,
            aux_loss=counts.new_zeros((), dtype=torch.float),
        )

    def exchange_counts(self, routing: Routing) -> Plan:
        if self.world == 1:  # every expert here: nothing to tell anyone
            counts = routing.kept_counts.reshape(1, -1)
            return Plan(counts, counts)
        return super().exchange_counts(routing)

    def dispatch_compute_combine(self, rows, plan, wrap=None):
        if self.world == 1 and wrap is None:
            return self.compute_experts(rows, plan)
        return super().dispatch_compute_combine(rows, plan, wrap)

    def compute_experts(self, received: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Step 5 with the model's own experts: rows regrouped by local expert, each through its SwiGLU."""
        W, E_local = plan.recv_counts.shape
        expert_of_row = torch.arange(E_local, device=plan.recv_counts.device).repeat(W)
        expert_of_row = expert_of_row.repeat_interleave(plan.recv_counts.reshape(-1))
        by_expert = expert_of_row.argsort(stable=True)
        weights = (self.gate_up_proj, self.down_proj)
        with span(f"moe/{self.name}/experts", rows=received.shape[0]):
            out = run_experts(received[by_expert], plan.expert_rows, weights, range(E_local), self.expert_function)
        return out[by_expert.argsort()]

    def gather_state(self, path: str, state: dict) -> None:
        """`state`'s slices of the fused tensors (keyed under `path`, or under a wrapper's `module.` prefix)
        replaced by the whole tensors, all-gathered over the group: the Hugging Face model's own entries."""
        for prefix in dict.fromkeys((path, path.removeprefix("module."))):
            for attr in ("gate_up_proj", "down_proj"):
                key = f"{prefix}.{attr}"
                if key in state and self.world > 1:
                    local = state[key]
                    everyone = local.new_empty((self.num_experts,) + tuple(local.shape[1:]))
                    comm.all_gather(everyone, local.contiguous(), group=self.group)
                    state[key] = everyone

    def expert_function(self, x, gate_up, down):
        """One expert on rows x, as the Hugging Face module computes it: (x W_gu^T) -> gate(.)·up -> W_d^T."""
        if getattr(self, "is_transposed", False):
            return self._apply_gate(x @ gate_up) @ down
        return self._apply_gate(x @ gate_up.t()) @ down.t()

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, expert-parallel over {self.world} rank(s), experts {self.first}.."
            f"{self.first + self.num_local - 1} of {self.num_experts}"
        )
