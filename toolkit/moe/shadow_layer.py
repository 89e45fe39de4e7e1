"""Shadowing in the layer (FasterMoE): each forward, decide which experts to shadow, then run steps 2-6.

The decision is the predictor's (``moe/shadow.py``: the performance model and Algorithm 1); this file
gives it the numbers and acts on them. With ``shadow="auto"`` or ``shadow=[...]`` the per-expert counts
are all-gathered (every rank needs everyone's to predict, and every rank reaches the same decision from
the same numbers); the chosen experts' weights are broadcast from their owners; their rows are taken
out of the dispatch and computed at home; the rest goes through the layer's own dispatch/compute/combine,
and the weights' traffic hides behind its computation (``moe/shadow_steps.py`` says where). The Run gets
``moe/{name}/shadow`` per forward: the experts shadowed, the predicted latency with and without, and
the measured one (forward + backward of these steps).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import comm
from ..trace.events import recorder
from .load import enclosing_step
from .machine import _label, _positive, machine_rates
from .plan import Plan
from .shadow import choose_shadows, predict
from .shadow_steps import ShadowUnits


class _Stamp(torch.autograd.Function):
    """Identity whose backward notes the time: where the backward of the shadowed steps starts and ends."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.note()
        return grad, None


class _Clock:
    """Measured latency of steps 2-6: forward time plus the backward from answers to rows (and the
    gradient returns of the shadowed experts), written into the metric's value as it happens."""

    def __init__(self, value: dict, forward_s: float):
        self.value, self.forward_s, self.start = value, forward_s, None

    def backward_start(self):
        self.start = time.perf_counter()

    def backward_end(self):
        if self.start is not None:
            self.value["measured_s"] = self.forward_s + time.perf_counter() - self.start


class Shadowing:
    """``shadow="auto"`` (Algorithm 1 each forward) or a forced list, for one MoE layer.

    compute_flops / bandwidth override the measured (or emulated) P and W_net. After each forward
    ``last`` is the ShadowChoice that ran.
    """

    def __init__(self, shadow, num_experts: int, *, compute_flops=None, bandwidth=None):
        if shadow == "auto":
            self.mode, self.forced = "auto", None
        elif isinstance(shadow, (list, tuple)):
            bad = [e for e in shadow if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < num_experts]
            if bad:
                raise ValueError(
                    f"shadow={list(shadow)!r}: expert(s) {bad} do not exist; this layer has experts "
                    f"0..{num_experts - 1} (global ids). Name existing experts, or use shadow='auto'."
                )
            self.mode, self.forced = "forced", sorted(set(shadow))
        else:
            raise ValueError(f"shadow={shadow!r}: choose 'off', 'auto' or a list of expert ids.")
        self.compute_flops = None if compute_flops is None else _positive("compute_flops", compute_flops)
        self.bandwidth = None if bandwidth is None else _positive("bandwidth", bandwidth)
        self.last = None

    def __repr__(self) -> str:
        return f"Shadowing({'auto' if self.mode == 'auto' else self.forced})"

    def decide(self, layer, counts, element_bytes) -> tuple:
        """(ShadowChoice, Rates) from the all-gathered (W, E) counts. Identical on every rank."""
        rates = machine_rates(
            layer.d_model, layer.d_ff, group=layer.group, compute_flops=self.compute_flops, bandwidth=self.bandwidth
        )
        owners = [e // layer.num_local for e in range(layer.num_experts)]
        model = dict(
            H=layer.d_model,
            alpha=layer.d_ff / layer.d_model,
            P=rates.compute_flops,
            W_net=rates.bandwidth,
            element_bytes=element_bytes,
        )
        if self.mode == "auto":
            return choose_shadows(counts, owners, **model), rates
        return predict(counts, owners, self.forced, **model), rates

    def forward(self, layer, tokens, routing):
        """Steps 2-6 with the shadowed experts at home. -> (plan, order, answers)"""
        started = time.perf_counter()
        W, El, E, r = layer.world, layer.num_local, layer.num_experts, layer.rank
        distributed = dist.is_initialized() and W > 1
        kept = routing.kept_counts
        if distributed:  # 2. everyone's counts: the predictor needs them all
            everyone = kept.new_empty(W * E)
            comm.all_gather(everyone, kept.contiguous(), group=layer.group)
            _label("counts")
            counts = everyone.reshape(W, E)
        else:
            counts = kept.reshape(1, E)
        choice, rates = self.decide(layer, counts.tolist(), tokens.element_size())
        self.last = choice
        shadowed = sorted(choice.shadowed)
        home_expert = torch.zeros(E, dtype=torch.bool, device=kept.device)
        home_expert[shadowed] = True
        travel = counts.masked_fill(home_expert, 0)  # shadowed experts' rows do not travel
        plan = Plan(travel[r].reshape(W, El).clone(), travel[:, r * El : (r + 1) * El].clone())

        value = {
            "mode": self.mode,
            "shadowed": shadowed,
            "predicted_s": choice.predicted_s,
            "plain_s": choice.plain_s,
            "loads": choice.loads,
            "loads_shadowed": choice.loads_shadowed,
            "trail": choice.trail,
            **rates.as_dict(),
            "measured_forward_s": None,
            "measured_s": None,
            "call": layer.calls + 1,
        }
        clock = _Clock(value, 0.0)

        order, rows = layer.sort_by_destination(tokens, routing)  # 3
        rows = _Stamp.apply(rows, clock.backward_end)
        if shadowed:  # 4-6: the rows that travel as the layer's pattern runs them, the others at home
            home = home_expert[routing.expert_index.reshape(-1)[order]]
            counts_home = [int(kept[e]) for e in shadowed]
            answers = layer.dispatch_compute_combine(
                rows, plan, wrap=lambda units: ShadowUnits(units, layer, home, shadowed, counts_home)
            )
        else:
            answers = layer.dispatch_compute_combine(rows, plan)
        answers = _Stamp.apply(answers, clock.backward_start)

        clock.forward_s = value["measured_forward_s"] = time.perf_counter() - started
        if recorder.enabled:
            recorder.metric(f"moe/{layer.name}/shadow", value, step=enclosing_step())
        return plan, order, answers
