"""fp16 training: dynamic loss scaling, the overflow check agreed across ranks, skipped steps in the Run.

fp16's range is 6e-8 (smallest subnormal) to 65504; bf16 has fp32's range. Without loss scaling, fp16
gradients below 6e-8 round to zero; with it they are lifted by the scale S before they are computed and
divided by S in fp32 before the step. A step whose gradients overflow is skipped on every rank and S
halves. One launch (`results()`, cached) runs every multi-rank check; the tests compare its numbers.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import toolkit
from toolkit.parallel import full_state_dict, wrap
from toolkit.train import TrainConfig

TINY = 1e-8  # gradients this small are below fp16's smallest subnormal (5.96e-8): they underflow to 0
STRATEGIES = ("local", "ddp", "zero1", "zero2", "zero3", "fsdp")
FP16_RUN = dict(
    steps=3, global_batch_size=8, model=dict(n_layer=1, d_model=32, n_head=2), seq_len=16, progress=False, clip=1.0
)


class Tiny(nn.Module):
    """loss = factor * sum(Wx), so dL/dW = factor * x: any gradient size we want, exactly known.
    W starts at 0, where fp32 resolves a change of 1e-8 (next to 0.3 it would round away)."""

    def __init__(self, factor: float = 1.0):
        super().__init__()
        self.lin, self.factor = nn.Linear(8, 1, bias=False), factor
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):
        return self.lin(x).sum() * self.factor


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def wrap_tiny(factor: float, strategy: str):
    options = {"wrap_policy": nn.Linear} if strategy == "fsdp" else {}  # the Linear is FSDP's unit
    return wrap(Tiny(factor), strategy, optimizer=sgd, mixed_precision=torch.float16, **options)


def weight(model) -> torch.Tensor:
    return full_state_dict(model)["lin.weight"].clone()


def tiny_update(strategy: str) -> torch.Tensor:
    """One step of SGD(lr=1) on gradients of 1e-8 in fp16; returns the change of the fp32 weights."""
    model, opt = wrap_tiny(TINY, strategy)
    before = weight(model)
    model.scaler.scale = 2.0**13  # S * 1e-8 = 8e-5: a normal fp16 number, and the loss gradient S fits
    model(torch.ones(8)).backward()
    opt.step()
    return weight(model) - before


def overflow_on_one_rank(strategy: str) -> dict:
    """Rank 1's input makes the gradient of the last weight overflow once scaled (1024 x 60000 > 65504).

    Under a sharded strategy that element lies in rank 1's slice only, so only rank 1 can see the inf:
    the ranks must agree to skip, or rank 0 would step its slice alone.
    """
    model, opt = wrap_tiny(1.0, strategy)
    before = weight(model)
    model.scaler.scale = 1024.0
    x = torch.ones(8)
    if torch.distributed.get_rank() == 1:
        x[7] = 6e4
    model(x).backward()
    opt.step()
    return {
        "changed": bool((weight(model) != before).any()),
        "scale": model.scaler.scale,
        "skipped": model.scaler.skipped,
    }


def everything():
    from toolkit.train import train

    out = {
        "runs": {
            s: train(TrainConfig(strategy=s, options={"mixed_precision": "fp16"}, **FP16_RUN))
            for s in ("ddp", "zero2", "fsdp")
        }
    }
    out["updates"] = {s: tiny_update(s) for s in STRATEGIES[1:]}
    out["overflow"] = {s: overflow_on_one_rank(s) for s in STRATEGIES[1:]}
    return out


@functools.cache
def results():
    return toolkit.launch(everything, 2, timeout_s=60)


# --- one process -------------------------------------------------------------------------------------
def test_fp16_gradients_below_the_subnormal_range_survive_with_loss_scaling():
    """Without scaling, 1e-8 rounds to 0 in fp16 and the step does nothing."""
    reference = -TINY * torch.ones(1, 8)  # SGD(lr=1) moves W by -dL/dW = -TINY * x
    assert torch.allclose(tiny_update("local"), reference, rtol=1e-3, atol=0)


def test_the_first_fp16_step_overflows_at_scale_2_16_and_is_skipped():
    """The loss's own gradient is S = 65536 > 65504 in fp16: DeepSpeed's famous first skipped step."""
    model, opt = wrap(Tiny(), "local", optimizer=sgd, mixed_precision="fp16")
    assert model.scaler.scale == 2.0**16
    before = model.module.lin.weight.detach().clone()
    model(torch.ones(8)).backward()
    opt.step()
    assert torch.equal(model.module.lin.weight, before)
    assert (model.scaler.scale, model.scaler.skipped, model.scaler.last_skipped) == (2.0**15, 1, True)


def test_the_scale_grows_after_growth_interval_good_steps():
    model, opt = wrap(Tiny(), "local", optimizer=sgd, mixed_precision="fp16")
    model.scaler.scale, model.scaler.growth_interval = 1024.0, 3
    scales = []
    for _ in range(4):
        model(torch.ones(8)).backward()
        opt.step()
        opt.zero_grad()
        scales.append(model.scaler.scale)
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0] and model.scaler.skipped == 0


def test_bf16_and_fp32_have_no_scaler():
    for mp in (False, True, torch.bfloat16):
        model, _ = wrap(Tiny(), "local", optimizer=sgd, mixed_precision=mp)
        assert model.scaler is None


# --- on two ranks --------------------------------------------------------------------------------------
@pytest.mark.usefixtures("no_leftover_ranks")
@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_every_strategy_unscales_fp16_gradients(strategy):
    reference = -TINY * torch.ones(1, 8)
    for rank in results():
        assert torch.allclose(rank["updates"][strategy], reference, rtol=1e-3, atol=0), strategy


@pytest.mark.usefixtures("no_leftover_ranks")
@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_an_overflow_seen_by_one_rank_skips_the_step_on_every_rank(strategy):
    for rank in results():
        assert rank["overflow"][strategy] == {"changed": False, "scale": 512.0, "skipped": 1}


@pytest.mark.usefixtures("no_leftover_ranks")
def test_the_run_records_the_loss_scale_and_the_skipped_steps():
    for rank in results():
        for strategy, run in rank["runs"].items():
            assert run.metric("skipped_step") == [(0, 1), (1, 0), (2, 0)], strategy
            assert run.metric("loss_scale") == [(0, 2.0**16), (1, 2.0**15), (2, 2.0**15)], strategy
    # the same arithmetic whatever the strategy: sharding changes where the bytes are, not the result
    final = {s: run.metric("param_norm")[0][1] for s, run in results()[0]["runs"].items()}
    assert max(final.values()) - min(final.values()) < 1e-3, final


# --- an average of N fp16 gradients is divided as torch divides it, not summed first ------------------
# Two ranks' loss-scaled gradients of 39,321 each: their sum, 78,642, is above fp16's 65,504 (inf), their
# average is not. torch DDP divides while copying into its bucket, torch FSDP divides by ~sqrt(N) before
# and the rest after (toolkit/comm/average.py): neither skips this step. At N = 4 FSDP divides by 2 before
# the sum, so the case there is 20,000 per rank: 80,000 summed first, 40,000 after dividing by 2. Hybrid
# sharding (2 shard groups of 2) divides at each of its two reductions: 39,321 fits again.
LARGE = {2: 39_321.0, 4: 20_000.0}
AVERAGED = {
    "dp": {},
    "ddp": {},
    "zero1": {},
    "zero1 all-reduce": {"reduce": "all_reduce"},
    "zero2": {},
    "zero3": {},
    "fsdp": {"wrap_policy": nn.Linear},
}
HYBRID = {"fsdp hybrid": {"wrap_policy": nn.Linear, "sharding_group_size": 2}}  # at N = 4: 2 x 2, so 39,321


def step_on_large_gradients(strategy: str, value: float, options: dict) -> dict:
    """Every rank's gradient is `value` (scale 1, SGD lr=1): skipped or not, and the update the weight took."""
    model, opt = wrap(Tiny(1.0), strategy.split()[0], optimizer=sgd, mixed_precision=torch.float16, **options)
    model.scaler.scale = 1.0
    before = weight(model)
    model(torch.full((8,), value)).backward()
    opt.step()
    return {"skipped": model.scaler.skipped, "update": weight(model) - before}


def torch_ddp_gradient(value: float) -> torch.Tensor:
    """What torch's own DDP makes of the same fp16 gradients on the same ranks (gloo)."""
    lin = nn.Linear(8, 1, bias=False).half()
    nn.init.zeros_(lin.weight)
    ddp = torch.nn.parallel.DistributedDataParallel(lin)
    ddp(torch.full((8,), value, dtype=torch.float16)).sum().backward()
    return lin.weight.grad.float()


def torch_fsdp2_gradient(value: float) -> torch.Tensor:
    """And torch's FSDP2 (`fully_shard`, fp16 parameters and reduction)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    lin = nn.Linear(8, 1, bias=False)
    nn.init.zeros_(lin.weight)
    fully_shard(
        lin,
        mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16),
    )
    lin(torch.full((8,), value)).sum().backward()
    return lin.weight.grad.full_tensor().float()


class GatheredExpert(nn.Module):
    """A dense weight, and an expert weight every rank uses through toolkit.moe's all-gather (Tutel's data-
    parallel placement): its gradient is the sum of every rank's contribution, reduce-scattered to its owner,
    then averaged by the strategy. dL/d(expert) = the sum over ranks of their x; its average is x."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1, bias=False)
        self.expert = nn.Parameter(torch.zeros(8))
        self.expert._toolkit_expert = True
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):
        from toolkit.moe.experts import GatherWeights

        world = torch.distributed.get_world_size()
        everyone = GatherWeights.apply(self.expert, None, world, "test", (self.expert,)).view(world, 8)
        return self.lin(x).sum() + (everyone * x).sum()


def step_on_large_expert_gradients(strategy: str, value: float) -> dict:
    model, opt = wrap(GatheredExpert(), strategy, optimizer=sgd, mixed_precision=torch.float16)
    model.scaler.scale = 1.0
    model(torch.full((8,), value)).backward()
    opt.step()
    return {"skipped": model.scaler.skipped, "update": model.module.expert.detach().float().reshape(1, 8)}


def moe_expert_gradients(experts: int, placement: dict) -> dict:
    """One fp16 backward (scale 1) of an MoE under DDP: this placement's averaged expert gradients."""
    from toolkit.moe import MoE

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), MoE(8, 16, experts, top_k=1, seed=0, **placement))
    model, _ = wrap(block, "ddp", optimizer=sgd, mixed_precision=torch.float16)
    model.scaler.scale = 1.0
    torch.manual_seed(1 + torch.distributed.get_rank())
    out, aux = model(torch.randn(32, 8))
    (out.float().square().sum() * 100 + aux).backward()
    return {name: p.grad.float() for name, p in block[1].experts.named_parameters()}


def large_gradients(value: float, strategies: dict) -> dict:
    out = {
        name: step_on_large_gradients(name, LARGE[2] if name in HYBRID else value, options)
        for name, options in strategies.items()
    }
    out.update({f"{s} experts": step_on_large_expert_gradients(s, value) for s in ("dp", "ddp")})
    out["torch"] = {"ddp": torch_ddp_gradient(value), "fsdp2": torch_fsdp2_gradient(value)}
    return out


MOE_PLACEMENTS = {  # (experts, options); on 2 ranks one expert is sliced in two (Tutel's EP+DP+MP)
    "ep": (2, {}),
    "dp": (2, {"expert_parallel": "dp"}),
    "shadowed": (2, {"shadow": [0, 1]}),
    "slices r=2": (1, {}),
    "slices r=1": (1, {"expert_slices": 1}),
    "slices dp": (1, {"expert_parallel": "dp"}),
}


def moe_placements() -> dict:
    return {name: moe_expert_gradients(*how) for name, how in MOE_PLACEMENTS.items()}


@functools.cache
def averages(world: int):
    strategies = dict(AVERAGED, **(HYBRID if world == 4 else {}))
    return toolkit.launch(large_gradients, world, args=(LARGE[world], strategies), timeout_s=120)


@pytest.mark.usefixtures("no_leftover_ranks")
@pytest.mark.parametrize("world", sorted(LARGE))
def test_an_fp16_average_whose_sum_overflows_is_not_a_skipped_step(world):
    value = torch.tensor(LARGE[world], dtype=torch.float16).float()  # the gradient fp16 holds: 39,328 (or 20,000)
    assert world * value > 65504, "the case must overflow when summed first"
    average = torch.full((1, 8), value.item())
    for rank, everything in enumerate(averages(world)):
        got = dict(everything)
        for system, grad in got.pop("torch").items():
            assert torch.equal(grad, average), f"torch {system}'s own average on rank {rank}: {grad}"
        skipped = [name for name, res in got.items() if res["skipped"]]
        assert not skipped, f"rank {rank} of {world}: {skipped} skipped a step torch DDP and FSDP2 take"
        for name, res in got.items():  # powers of two divide exactly: the update is the average, to the bit
            if name.endswith("experts"):  # SGD moved the expert weight by its averaged gradient
                assert torch.equal(res["update"], -average), (name, res["update"])
                continue
            want = torch.full((1, 8), torch.tensor(LARGE[2], dtype=torch.float16).item()) if name in HYBRID else average
            assert torch.equal(res["update"], -want), (name, res["update"])


@pytest.mark.usefixtures("no_leftover_ranks")
def test_the_moe_placements_average_fp16_expert_gradients_alike():
    """Expert gradients come home by different sums (the experts' own backward, a reduce-scatter of gathered
    weights, an all-reduce of shadow copies); the fp16 ones predivide (moe/experts.py), the others not, and
    the strategy divides by what is left: every placement must end at the same average. A factor of 2
    would show; fp16 rounding along different paths stays within a few of its 2^-11 steps."""
    for rank, got in enumerate(toolkit.launch(moe_placements, 2, timeout_s=120)):
        for name, like in (("dp", "ep"), ("shadowed", "ep"), ("slices r=1", "slices r=2"), ("slices dp", "slices r=2")):
            for weight_name, grad in got[name].items():
                want = got[like][weight_name]
                assert torch.allclose(grad, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()), (
                    rank,
                    name,
                    weight_name,
                    (grad - want).abs().max(),
                )
