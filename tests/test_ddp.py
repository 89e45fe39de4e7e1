"""Data parallelism ("dp", "ddp") checked against the one-process oracle ("local") and torch's own DDP.

Every rank trains on its contiguous slice of the same global batch; averaging gradients must then give
the step one process takes on the whole batch. Each world size is one launch (`results(n)`, cached)
that runs every check for that size; the tests below only compare numbers, so a launch's 2-4 s of
start-up is paid once per world size.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn

import toolkit
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel import full_state_dict, wrap
from toolkit.parallel.ddp import assign_buckets

STEPS, GLOBAL_BATCH, LR, CLIP = 3, 12, 1e-3, 1.0  # 12 splits evenly over 1, 2, 3 and 4 ranks
OPT = functools.partial(torch.optim.AdamW, lr=LR)
SMALL = 0.01  # MiB: about 10 KB, so the 114 KB tiny GPT spreads over many buckets
ATOL = 1e-5  # fp32: different summation orders only
PARITY = {"dp": ("dp", {}), "ddp": ("ddp", {}), "ddp_small": ("ddp", {"bucket_cap_mb": SMALL})}


def build(**overrides):
    torch.manual_seed(0)
    return tiny_gpt(**overrides)


def train(model, opt, rank=0, world_size=1, steps=STEPS, clip=CLIP):
    """The plain loop; returns this rank's losses and the gradient norms clip_grad_norm_ reported."""
    corpus, losses, norms = SyntheticCorpus(), [], []
    for step in range(steps):
        x, y = corpus.batch(step, GLOBAL_BATCH, rank=rank, world_size=world_size)
        loss = model(x, y)
        loss.backward()
        norms.append(model.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().item())
    return losses, norms


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@functools.cache
def oracle(mixed_precision=False):
    model, opt = wrap(build(), "local", optimizer=OPT, mixed_precision=mixed_precision)
    losses, norms = train(model, opt)
    return losses, norms, full_state_dict(model)


# --- what every rank runs ---------------------------------------------------------------------------
class Toy(nn.Module):
    """Two layers; the second is used only when asked (to check unused parameters)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_second=True):
        out = self.first(x)
        return (out + self.second(x) if use_second else out).pow(2).sum()


def bucket_step(rank, n):
    """One ddp step with small buckets: when did the all-reduces start, and how many bytes went?"""
    from toolkit.trace import phase, recorder

    model = build()
    first = model.tok_emb.weight  # registered first, so backward finishes its gradient last
    seen = {}

    def count_started(param):  # registered before wrap, so it runs before DDP's own hook on `first`
        seen.setdefault("started", sum(e["name"] == "all_reduce" for e in recorder.events))

    first.register_post_accumulate_grad_hook(count_started)
    model, opt = wrap(model, "ddp", optimizer=OPT, bucket_cap_mb=SMALL)
    recorder.reset()
    x, y = SyntheticCorpus().batch(0, GLOBAL_BATCH, rank=rank, world_size=n)
    with phase("backward"):
        model(x, y).backward()
    comms = [e for e in recorder.events if e["cat"] == "comm"]
    return {
        "order": [i for b in model.buckets for i in b.indices],
        "num_params": len(model.params),
        "bucket_bytes": [b.buffer.numel() * b.buffer.element_size() for b in model.buckets],
        "bucket_numel": sum(b.buffer.numel() for b in model.buckets),
        "names": [e["name"] for e in comms],
        "phases": {e["phase"] for e in comms},
        "async": all(e["args"]["async_op"] for e in comms),
        "sent": [e["args"]["bytes_sent"] for e in comms],
        "started_before_last_grad": seen["started"],
    }


def no_sync_step(rank, n, strategy):
    """Two micro-batches under no_sync, then one synchronised: the same as one step on all rows."""
    from toolkit.trace import recorder

    model, opt = (
        wrap(build(), strategy, optimizer=OPT, bucket_cap_mb=SMALL)
        if strategy == "ddp"
        else wrap(build(), strategy, optimizer=OPT)
    )
    x, y = SyntheticCorpus().batch(0, 2 * GLOBAL_BATCH, rank=rank, world_size=n)
    half = x.shape[0] // 2
    recorder.reset()
    with model.no_sync():
        (model(x[:half], y[:half]) / 2).backward()
    silent = len(recorder.events) == 0
    (model(x[half:], y[half:]) / 2).backward()
    opt.step()
    return silent, full_state_dict(model)


def unused_step(rank, strategy):
    """Rank 0 uses the second layer, rank 1 does not: its gradient is rank 0's divided by 2."""
    torch.manual_seed(0)
    toy = Toy()
    model, _ = (
        wrap(toy, strategy, optimizer=OPT)
        if strategy == "dp"
        else wrap(toy, strategy, optimizer=OPT, bucket_cap_mb=1e-5)
    )  # one bucket per tensor
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    model(x, use_second=rank == 0).backward()
    return {n: p.grad.clone() for n, p in toy.named_parameters()}


class Swapped(nn.Module):
    """`late` is registered first but runs last: registration order is the wrong guess for backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.late, self.early = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.late(self.early(x)).pow(2).sum()


def rebuild_steps(rank, n, steps=3):
    """ddp on Swapped, one bucket per layer: the buckets per step, how many all-reduces had started
    when backward reached `early`, and the broadcasts (the rebuild's) per step."""
    from toolkit.trace import recorder

    toy, started = Swapped(), []
    toy.early.weight.register_post_accumulate_grad_hook(  # before wrap: runs before DDP's own hook
        lambda p: started.append(sum(e["name"] == "all_reduce" for e in recorder.events))
    )
    model, opt = wrap(toy, "ddp", optimizer=functools.partial(torch.optim.SGD, lr=0.1), bucket_cap_mb=64 / 2**20)
    buckets, broadcasts = [], []
    torch.manual_seed(1)
    xs = torch.randn(steps, n, 3, 4)
    for step in range(steps):
        recorder.reset()
        loss = model(xs[step, rank])
        buckets.append([b.indices for b in model.buckets])
        loss.backward()
        opt.step()
        opt.zero_grad()
        broadcasts.append(sum(e["name"] == "broadcast" for e in recorder.events))
    return {"buckets": buckets, "started": started, "broadcasts": broadcasts, "state": full_state_dict(model), "xs": xs}


def first_bucket(rank):
    """Three 512 KiB layers: the default cap's first bucket closes at 1 MiB; an explicit cap is every bucket's."""
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(512, 256, bias=False) for _ in range(3)))
    default, _ = wrap(layers, "ddp", optimizer=OPT)
    explicit, _ = wrap(layers, "ddp", optimizer=OPT, bucket_cap_mb=25)
    return [b.indices for b in default.buckets], [b.indices for b in explicit.buckets]


def torch_ddp_run(rank, n):
    """The same training with torch.nn.parallel.DistributedDataParallel (the peer, not the toolkit)."""
    model = torch.nn.parallel.DistributedDataParallel(build())
    opt = OPT(model.parameters())
    corpus, losses = SyntheticCorpus(), []
    for step in range(STEPS):
        x, y = corpus.batch(step, GLOBAL_BATCH, rank=rank, world_size=n)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.module.named_parameters()}


def everything(n):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    if n == 3:  # a mismatched model must be a clear error on every rank, not a hang
        try:
            wrap(build(n_layer=3 if rank == 2 else 2), "ddp", optimizer=OPT)
            out["mismatch"] = None
        except ValueError as exc:
            out["mismatch"] = str(exc)
    for key, (strategy, options) in PARITY.items():
        model, opt = wrap(build(), strategy, optimizer=OPT, **options)
        out[key] = train(model, opt, rank, n) + (full_state_dict(model),)
    if n == 3:  # the same DDP over the hand-written ring (synchronous: correct, without overlap)
        with toolkit.comm.using("ring"):
            model, opt = wrap(build(), "ddp", optimizer=OPT, bucket_cap_mb=SMALL)
            out["ddp_ring"] = train(model, opt, rank, n) + (full_state_dict(model),)
    out["buckets"] = bucket_step(rank, n)
    if n == 2:
        out["torch_ddp"] = torch_ddp_run(rank, n)
        out["rebuild"] = rebuild_steps(rank, n)
        out["first_bucket"] = first_bucket(rank)
        for strategy in ("dp", "ddp"):
            out[f"no_sync_{strategy}"] = no_sync_step(rank, n, strategy)
            out[f"unused_{strategy}"] = unused_step(rank, strategy)
            options = dict(PARITY["ddp_small"][1]) if strategy == "ddp" else {}
            model, opt = wrap(build(), strategy, optimizer=OPT, mixed_precision=True, **options)
            out[f"mp_{strategy}"] = train(model, opt, rank, n) + (full_state_dict(model),)
            out[f"mp_{strategy}_dtypes"] = (
                {str(p.dtype) for p in model.module.parameters()},
                {str(t.dtype) for t in model.memory_groups()["grads"]},
            )
    return out


@functools.cache
def results(n):
    return toolkit.launch(everything, n, args=(n,), timeout_s=60)


# --- in this process --------------------------------------------------------------------------------
def test_unknown_option_lists_the_valid_ones():
    for strategy, valid in (("dp", "mixed_precision"), ("ddp", "bucket_cap_mb"), ("local", "mixed_precision")):
        with pytest.raises(ValueError, match=valid):
            wrap(build(), strategy, optimizer=OPT, bucket_size=3)
    with pytest.raises(ValueError, match="mixed_precision"):
        wrap(build(), "local", optimizer=OPT, mixed_precision="fp8")
    with pytest.raises(ValueError, match="is for fsdp, zero1 and zero2"):  # a policy with a reduction dtype
        wrap(build(), "local", optimizer=OPT, mixed_precision=dict(param_dtype="bf16", reduce_dtype="fp32"))


def test_buckets_are_reverse_registration_order_and_capped():
    params = [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)]  # 4 bytes each element
    assert assign_buckets(params, cap_bytes=60) == [[5, 4, 3], [2], [1, 0]]
    assert assign_buckets(params, cap_bytes=1e9) == [[5, 4, 3, 2, 1, 0]]
    assert assign_buckets(params, cap_bytes=1) == [[i] for i in reversed(range(6))]


def test_the_first_bucket_has_its_own_cap_and_buckets_follow_a_given_order():
    params = [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)]  # 4 bytes each element
    assert assign_buckets(params, cap_bytes=60, first_cap_bytes=40) == [[5, 4], [3, 2], [1, 0]]
    assert assign_buckets(params, cap_bytes=60, order=[0, 1, 2, 3, 4, 5]) == [[0, 1], [2], [3, 4, 5]]


def test_local_is_the_plain_loop():
    """Without clipping, "local" is bit for bit the unwrapped model with its own optimizer."""
    plain = build()
    opt = OPT(plain.parameters())
    model, local_opt = wrap(build(), "local", optimizer=OPT)
    (want_losses, want_norms), (losses, norms) = train(_Plain(plain), opt, clip=1e9), train(model, local_opt, clip=1e9)
    assert losses == want_losses
    assert max(abs(a - b) for a, b in zip(norms, want_norms)) < 1e-6  # torch sums the squares in another order
    assert max_diff(full_state_dict(model), dict(plain.named_parameters())) == 0
    x, y = SyntheticCorpus().batch(0, GLOBAL_BATCH)
    model(x, y).backward()
    plain(x, y).backward()
    assert abs(model.clip_grad_norm_(0.1).item() - _Plain(plain).clip_grad_norm_(0.1).item()) < 1e-6
    assert (
        max_diff(
            {n: p.grad for n, p in model.module.named_parameters()}, {n: p.grad for n, p in plain.named_parameters()}
        )
        < 1e-7
    )


class _Plain(nn.Module):
    """The unwrapped model with torch's clip, so `train` can drive it."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *a):
        return self.module(*a)

    def clip_grad_norm_(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)


def test_local_mixed_precision_keeps_fp32_masters():
    model, opt = wrap(build(), "local", optimizer=OPT, mixed_precision=True)
    x, y = SyntheticCorpus().batch(0, 4)
    model(x, y).backward()
    opt.step()  # Adam's states exist from here on
    model(x, y).backward()
    psi = model.module.num_params()
    groups = model.memory_groups()
    nbytes = {k: sum(t.numel() * t.element_size() for t in v) for k, v in groups.items()}
    steps = sum(1 for s in opt.state.values() for t in s.values() if t.numel() == 1)  # Adam's step counters
    assert {p.dtype for p in model.module.parameters()} == {torch.bfloat16}
    assert {p.dtype for g in opt.param_groups for p in g["params"]} == {torch.float32}
    assert nbytes["params"] == 2 * psi and nbytes["grads"] == 2 * psi  # the "2 + 2" of 2 + 2 + K
    assert nbytes["optimizer"] == 12 * psi + 4 * steps  # K = 12: master, momentum, variance
    assert all(v.dtype == torch.float32 for v in full_state_dict(model).values())
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.module.parameters())  # the step consumed the 16-bit grads


# --- across ranks -----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_parity_with_local(n):
    want_losses, want_norms, want_state = oracle()
    runs = results(n)
    for key in [k for k in (*PARITY, "ddp_ring") if k in runs[0]]:
        losses = [sum(r[key][0][s] for r in runs) / n for s in range(STEPS)]  # the global batch's mean loss
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < ATOL, key
        for r in runs:
            assert max(abs(a - b) for a, b in zip(r[key][1], want_norms)) < ATOL, key  # clip_grad_norm_
            assert max_diff(r[key][2], want_state) < ATOL, key
            assert max_diff(r[key][2], runs[0][key][2]) == 0, key  # every rank holds the same model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_buckets_launch_during_backward_and_send_the_ring_bytes(n):
    for r in results(n):
        b = r["buckets"]
        assert b["order"] == list(reversed(range(b["num_params"])))
        assert len(b["bucket_bytes"]) >= 3 and b["names"] == ["all_reduce"] * len(b["bucket_bytes"])
        assert b["bucket_numel"] == build().num_params()
        assert b["phases"] == {"backward"} and b["async"]
        # every bucket but the last (which holds the embedding) started before backward reached the embedding
        assert b["started_before_last_grad"] == len(b["bucket_bytes"]) - 1
        assert b["sent"] == [2 * (n - 1) * size // n for size in b["bucket_bytes"]]
        assert abs(sum(b["sent"]) - 2 * (n - 1) / n * 4 * build().num_params()) < len(b["sent"])


@pytest.mark.timeout(120)
def test_default_cap_has_a_1_mib_first_bucket_as_torch():
    for r in results(2):
        default, explicit = r["first_bucket"]
        assert default == [[2, 1], [0]]  # 512 KiB + 512 KiB reach 1 MiB: the first bucket closes
        assert explicit == [[2, 1, 0]]  # bucket_cap_mb=25 given: one 25 MiB cap for every bucket


@pytest.mark.timeout(120)
def test_buckets_are_rebuilt_in_the_order_gradients_became_ready():
    """Registration order puts `early` (run first, so ready last) in bucket 0: the first backward can
    launch nothing until the end. The next forward rebuilds the buckets in the order gradients arrived
    (one broadcast of rank 0's order, once), and from then on `late`'s bucket leaves while backward
    is still computing `early`'s gradients. The arithmetic is unchanged."""
    runs = results(2)
    for r in runs:
        b = r["rebuild"]
        assert b["buckets"][0] == [[3, 2], [1, 0]]  # early.bias, early.weight first: the wrong guess
        assert b["buckets"][1] == b["buckets"][2] and sorted(map(sorted, b["buckets"][1])) == [[0, 1], [2, 3]]
        assert set(b["buckets"][1][0]) == {0, 1}  # late's parameters lead now
        assert b["started"] == [0, 1, 1]  # all-reduces in flight when backward reached early.weight
        assert b["broadcasts"] == [0, 1, 0]
    model, opt = wrap(Swapped(), "local", optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    for x in runs[0]["rebuild"]["xs"]:
        model(x.reshape(-1, 4)).backward()  # the sum of both ranks' losses, so gradients are 2x the mean
        for p in model.parameters():
            p.grad /= 2
        opt.step()
        opt.zero_grad()
    assert max_diff(runs[0]["rebuild"]["state"], full_state_dict(model)) < ATOL


@pytest.mark.timeout(120)
def test_parity_with_torch_ddp():
    runs = results(2)
    for r in runs:
        losses, state = r["torch_ddp"]
        assert max(abs(a - b) for a, b in zip(losses, r["ddp"][0])) < ATOL
        assert max_diff(state, r["ddp"][2]) < ATOL


@pytest.mark.timeout(120)
def test_no_sync_accumulation_equals_one_big_step():
    model, opt = wrap(build(), "local", optimizer=OPT)
    x, y = SyntheticCorpus().batch(0, 2 * GLOBAL_BATCH)
    model(x, y).backward()
    opt.step()
    want = full_state_dict(model)
    for r in results(2):
        for strategy in ("dp", "ddp"):
            silent, state = r[f"no_sync_{strategy}"]
            assert silent, f"{strategy}: no_sync must not communicate"
            assert max_diff(state, want) < ATOL, strategy


@pytest.mark.timeout(120)
def test_parameter_unused_on_one_rank_averages_with_zeros():
    want = {}
    for use_second in (True, False):  # what rank 0 and rank 1 compute on their own
        torch.manual_seed(0)
        toy = Toy()
        torch.manual_seed(1)
        toy(torch.randn(3, 4), use_second=use_second).backward()
        for name, p in toy.named_parameters():
            want[name] = want.get(name, 0) + (0 if p.grad is None else p.grad / 2)
    for strategy in ("dp", "ddp"):
        for r in results(2):
            assert max_diff(r[f"unused_{strategy}"], want) < 1e-6, strategy


@pytest.mark.timeout(120)
def test_mixed_precision_matches_local_mixed_precision():
    """bf16 runs match the oracle with the same policy up to bf16 rounding, bounded as follows.

    Losses: bf16 keeps 8 significant bits, so a loss near 4 is a multiple of 2^-5 = 0.031 ("one ulp").
    Each rank's loss and the oracle's are rounded (up to half an ulp each), and their bf16 sums run
    in a different order over different rows: allow 2 ulps.
    Master weights (fp32): the gradients differ by rounding, and Adam normalises every update to
    about lr, so two runs drift apart by at most ~2 lr per step: allow 2 * lr * steps.
    """
    want_losses, _, want_state = oracle(mixed_precision=True)
    fp32_losses = oracle()[0]
    ulp = lambda v: 2.0 ** (math.floor(math.log2(abs(v))) - 7)  # noqa: E731
    runs = results(2)
    for strategy in ("dp", "ddp"):
        losses = [sum(r[f"mp_{strategy}"][0][s] for r in runs) / 2 for s in range(STEPS)]
        for got, want, fp32 in zip(losses, want_losses, fp32_losses):
            assert abs(got - want) <= 2 * ulp(want), strategy
            assert abs(got - fp32) <= 4 * ulp(fp32), strategy  # and bf16 stays close to fp32 training
        for r in runs:
            state = r[f"mp_{strategy}"][2]
            assert all(v.dtype == torch.float32 for v in state.values())
            assert max_diff(state, want_state) <= 2 * LR * STEPS, strategy
            assert max_diff(state, runs[0][f"mp_{strategy}"][2]) == 0, strategy
            params, grads = r[f"mp_{strategy}_dtypes"]
            assert params == {"torch.bfloat16"} and grads <= {"torch.bfloat16"}  # buckets are 16-bit too


@pytest.mark.timeout(120)
def test_mismatched_models_name_the_ranks():
    for r in results(3):
        assert r["mismatch"] is not None and "ranks [0, 1] vs [2]" in r["mismatch"]
