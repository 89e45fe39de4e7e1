"""`toolkit.parallel.shard_optimizer`: ZeRO-1 as an optimizer alone, shaped like torch's
ZeroRedundancyOptimizer. One launch of 2 ranks trains the same model twice side by side, DDP with the
plain optimizer and DDP with the sharded one: every step must leave bit-identical parameters on
every rank, with two param groups of their own options and a learning-rate scheduler; the ledger must
show each rank holding half the optimizer states, and the trace one broadcast per owner per step."""

import functools

import pytest
import torch
import torch.nn as nn

import toolkit
from toolkit.memory import ledger
from toolkit.parallel import shard_optimizer, wrap

STEPS = 3


def net():
    torch.manual_seed(0)  # 2 x (256 + 16) elements: the greedy owners split them exactly in half
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


def groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 3e-2}]


def side_by_side():
    import torch.distributed as dist

    from toolkit.trace.events import recorder

    rank = dist.get_rank()
    plain_model, _ = wrap(net(), "ddp")
    sharded_model, _ = wrap(net(), "ddp")
    plain = torch.optim.AdamW(groups(plain_model.module), lr=1e-2)
    sharded = shard_optimizer(groups(sharded_model.module), torch.optim.AdamW, lr=1e-2)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, sharded)]
    torch.manual_seed(1 + rank)  # each rank its own rows
    identical, broadcasts = [], []
    for _ in range(STEPS):
        x = torch.randn(8, 16)
        for model, opt in ((plain_model, plain), (sharded_model, sharded)):
            model(x).pow(2).mean().backward()
            before = len(recorder.events)
            opt.step()
            opt.zero_grad()
            if opt is sharded:
                broadcasts.append(sum(e["name"] == "broadcast" for e in recorder.events[before:]))
        for s in schedulers:
            s.step()
        identical.append(all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), sharded_model.parameters())))
    return {
        "identical": identical,
        "broadcasts": broadcasts,
        "lr": [g["lr"] for g in sharded.local.param_groups],
        "plain": ledger(plain_model.module, plain)["optimizer"],
        "sharded": ledger(sharded_model.module, sharded)["optimizer"],
        "owned": sum(p.numel() for p in sharded.owned()),
        "params": [p.detach().clone() for p in sharded_model.parameters()],
    }


@pytest.mark.timeout(120)
def test_sharded_optimizer_matches_the_plain_one_exactly_with_half_the_states(no_leftover_ranks):
    ranks = toolkit.launch(side_by_side, 2)
    for r in ranks:
        assert r["identical"] == [True] * STEPS  # fp32, bit for bit: the same update, just elsewhere
        assert r["broadcasts"] == [2] * STEPS  # one flat message per owner (one dtype)
        assert r["lr"] == [1e-2 * 0.5 ** (STEPS - 1), 3e-2 * 0.5 ** (STEPS - 1)]  # the scheduler reached the last step
        assert r["owned"] == 272
        # AdamW: exp_avg and exp_avg_sq (8 bytes per element) and a 4-byte step per tensor: half of each
        assert r["plain"] == 544 * 8 + 4 * 4 and r["sharded"] == r["plain"] // 2
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))


def test_what_cannot_be_sharded_is_refused_clearly():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(TypeError, match="optimizer class"):
        shard_optimizer(p, functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ValueError, match="every parameter at once"):
        shard_optimizer(p, torch.optim.LBFGS)
    with pytest.raises(RuntimeError, match="toolkit.launch"):
        shard_optimizer(p, torch.optim.SGD, lr=0.1)
