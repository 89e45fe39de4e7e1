"""ZeRO stages 1, 2, 3 checked against one process, against theory, and against torch's own versions.

Every rank trains on its contiguous slice of the same global batch, so every stage must reproduce a
plain one-process torch loop (torch.optim.AdamW on the full batch): same losses, same parameters.
Each world size is one launch (`results(n)`, cached) that runs every check for that size; the tests
below only compare the numbers it brought back.

The model: the tiny GPT with a tied head and a shape chosen so that Ψ = 19,006 divides by neither 3
nor 4 (nor do most of its per-module units), so padding is exercised at every world size but 1 and 2.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import pytest
import torch
from oracle import plain_training

import toolkit
from toolkit.memory import communication_per_step, model_states_breakdown
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel import wrap
from toolkit.parallel.flat import FlatBuffer, padded_numel

CFG = dict(vocab_size=63, d_model=26, n_head=2, seq_len=16)  # Ψ = 19,006: not a multiple of 3 or 4
DATA = dict(vocab_size=63, seq_len=16)
PSI = 19006
STEPS, GLOBAL_BATCH, LR = 4, 12, 1e-3  # 12 rows split evenly over 1, 2, 3 and 4 ranks
OPT = functools.partial(torch.optim.AdamW, lr=LR)
ATOL = 1e-5  # fp32: only the order of floating-point sums differs
CLIP = 0.05  # well below the gradient norms (about 0.3-1), so every step clips
SMALL = 0.01  # MiB: the 76 KB model spreads over several ZeRO-1/2 buckets
BUCKET = 5000  # elements: ZeRO-3's buckets hold a few modules each (a block has about 8,000 parameters)
STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
# Mixed precision (bfloat16 compute, fp32 masters), compared with the same recipe in one process.
# Losses are bf16 numbers near 4.1, where bf16's spacing is 1/32. The ranks' cross-entropies round
# differently from the whole batch's inside the reduction, not only at the end (on the same weights the
# full batch's bf16 loss and the mean of its halves' differ by up to one spacing): allow 3 spacings.
# Parameters: ranks average bf16 gradients, which rounds them again. Adam moves every element by about
# lr per step whatever its gradient's size, so the few elements whose gradient is near zero can flip
# the sign of their update: the largest difference is bounded only by 2 * lr * STEPS. The typical
# element agrees far better: mean |difference| below 1e-4 (an element moves about 3e-3 in 4 steps,
# so a wrong update would show) and 99% of the elements within 5e-4.
MP_LOSS_ATOL = 3 / 32
MP_PARAM_MAX, MP_PARAM_MEAN, MP_PARAM_P99 = 2 * LR * STEPS, 1e-4, 5e-4
# bf16 compute, gradients accumulated and reduced in fp32 (Megatron-LM's main gradients; DeepSpeed's BF16_Optimizer)
MAIN_GRADS = dict(param_dtype="bf16", reduce_dtype="fp32")
FP32_REDUCE = {
    "zero1_fp32_reduce": {},
    "zero1_fp32_reduce_small_all_reduce": dict(bucket_cap_mb=SMALL, reduce="all_reduce"),
    "zero1_fp32_reduce_overlap": dict(bucket_cap_mb=SMALL, overlap_grad_reduce=True, overlap_param_gather=True),
    "zero1_fp32_reduce_accumulate": dict(micro=2),
    "zero2_fp32_reduce": dict(bucket_cap_mb=SMALL),
    "zero2_fp32_reduce_accumulate": dict(micro=2),
}


def build(**overrides):
    torch.manual_seed(0)
    return tiny_gpt(**{**CFG, **overrides})


def batches(rank=0, world_size=1, steps=STEPS):
    corpus = SyntheticCorpus(**DATA)
    return [corpus.batch(s, GLOBAL_BATCH, rank=rank, world_size=world_size) for s in range(steps)]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# --- the oracles: plain torch loops in this process --------------------------------------------------
@functools.cache
def oracle(clip=None, mixed=False):
    """Losses, clip norms and final parameters of one process on the whole batch, torch only."""
    return plain_training(build(), batches(), OPT, clip=clip, mixed=mixed)


# --- what every rank runs ------------------------------------------------------------------------------
def storage_bytes(groups: dict) -> dict:
    """Bytes per category, a storage counted once (in its first category), freed storages as 0."""
    seen, out = set(), {}
    for category in ("params", "grads", "optimizer"):
        out[category] = 0
        for t in groups[category]:
            if t is None or t.untyped_storage().nbytes() == 0 or t.untyped_storage().data_ptr() in seen:
                continue
            seen.add(t.untyped_storage().data_ptr())
            out[category] += t.untyped_storage().nbytes()
    return out


def train(rank, n, strategy, clip=None, micro=1, **options):
    """The plain loop on this rank's rows. Measures memory (after the last step, before zero_grad) and
    the bytes this rank sent during the last step (forward, backward and step; no clipping then)."""
    from toolkit.trace import recorder

    model, opt = wrap(build(), strategy, optimizer=OPT, **options)
    losses, norms = [], []
    for step, (x, y) in enumerate(batches(rank, n)):
        last = step == STEPS - 1
        start = len(recorder.events)
        if micro == 1:
            loss = model(x, y)
            loss.backward()
        else:  # micro-batches, as toolkit.train does: all but the last under no_sync() (ZeRO-1 then
            rows, loss = x.shape[0] // micro, 0.0  # does not communicate; ZeRO-2/3 reduce all the same)
            for i in range(micro):
                with model.no_sync() if i < micro - 1 else contextlib.nullcontext():
                    part = model(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) / micro
                    part.backward()
                loss = loss + part.detach()
        if clip is not None:
            norms.append(model.clip_grad_norm_(clip).item())
        opt.step()
        if last:
            sent = sum(e["args"]["bytes_sent"] for e in recorder.events[start:] if e["cat"] == "comm")
            calls = collections.Counter(e["name"] for e in recorder.events[start:] if e["cat"] == "comm")
            order = [(e["name"], e["args"]["async_op"]) for e in recorder.events[start:] if e["cat"] == "comm"]
            memory = storage_bytes(model.memory_groups())
            gathered = [f for f in model.flat_buffers() if f.is_allocated]  # the gathered copies: 0 bytes
            freed = not gathered and all(map(model.engine.sharded_now, model.module.parameters()))  # pieces
        opt.zero_grad()
        losses.append(loss.float().item())
    with torch.no_grad():  # the wrapped model's outputs, to compare with a plain model's
        logits = model(batches(0, 1, steps=1)[0][0]).float()
    flats = model.flat_buffers()
    return {
        "losses": losses,
        "norms": norms,
        "params": model.full_state_dict(),
        "memory": memory,
        "logits": logits,
        "sent": sent,
        "calls": dict(calls),
        "order": order,
        "freed": freed,
        "padded": sum(f.padded_numel for f in flats),
        "padding": sum(f.padding for f in flats),
        "shards": len(flats),
        "dtype_bytes": flats[0].data.element_size(),
    }


def peer_zero_redundancy(rank, n):
    """torch's ZeroRedundancyOptimizer (whole parameters per rank) under torch DDP."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = build()
    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    losses = []
    for x, y in batches(rank, n):
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def peer_fsdp2(rank, n, mp_policy=None):
    """torch's FSDP2: fully_shard on every block, then the root (which holds the tied embedding/head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build()
    mesh = init_device_mesh("cpu", (n,))
    policy = dict(mp_policy=MixedPrecisionPolicy(**mp_policy)) if mp_policy else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    opt = OPT(model.parameters())
    losses = []
    for x, y in batches(rank, n):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}}


def errors(rank, n):
    """Misuse on real ranks: each must raise a clear error on every rank (no hang)."""
    found = {}

    def catch(key, fn):
        try:
            fn()
        except (ValueError, RuntimeError) as exc:
            found[key] = f"{type(exc).__name__}: {exc}"

    catch("mismatch", lambda: wrap(build(d_model=26 if rank == 0 else 28), "zero2", optimizer=OPT))
    model, opt = wrap(build(), "zero1", optimizer=OPT)
    ((x, y),) = batches(rank, n, steps=1)

    def twice():
        model(x, y).backward()
        model(x, y).backward()  # no zero_grad, no no_sync: the slice would be averaged twice

    catch("zero1_twice", twice)
    opt.zero_grad()

    def only_no_sync():
        with model.no_sync():
            model(x, y).backward()
        opt.step()

    catch("zero1_no_sync_only", only_no_sync)
    model, opt = wrap(build(), "zero1", optimizer=OPT, overlap_param_gather=True, overlap_grad_reduce=True)
    model(x, y).backward()
    catch("zero1_overlap_twice", lambda: model(x, y).backward())
    opt.zero_grad()
    model(x, y).backward()
    opt.step()
    catch("stale state_dict", model.state_dict)  # the gathers wait for the next forward
    catch("overlap not a bool", lambda: wrap(build(), "zero1", optimizer=OPT, overlap_grad_reduce="yes"))
    catch("overlap on zero3", lambda: wrap(build(), "zero3", optimizer=OPT, overlap_param_gather=True))
    return found


def scheduler_and_state_dict(rank, n):
    """The sharded optimizer is a torch Optimizer: an LR scheduler drives it, state_dict() sees its slices."""
    model, opt = wrap(build(), "zero2", optimizer=OPT)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ((x, y),) = batches(rank, n, steps=1)
    model(x, y).backward()
    opt.step()
    schedule.step()
    state = opt.state_dict()
    return {
        "lr": opt.inner.param_groups[0]["lr"],
        "states": len(state["state"]),
        "moment": tuple(next(iter(state["state"].values()))["exp_avg"].shape),
    }


def run_rank(n):
    rank = torch.distributed.get_rank()
    out = {}
    for strategy in STAGES:
        out[strategy] = train(rank, n, strategy)
    if n == 1:
        out["scheduler"] = scheduler_and_state_dict(rank, n)
        return out
    out["zero1_small"] = train(rank, n, "zero1", bucket_cap_mb=SMALL)
    out["zero2_small"] = train(rank, n, "zero2", bucket_cap_mb=SMALL)
    # DeepSpeed's buckets: a whole block's units per all-gather, about as much per reduce-scatter
    out["zero3_buckets"] = train(rank, n, "zero3", prefetch_bucket_size=BUCKET, reduce_bucket_size=BUCKET)
    if n == 4:  # two groups of two ranks, each sharding over its own group: each is a world of 2
        groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
        out["zero3_group"] = train(rank % 2, 2, "zero3", group=groups[rank // 2])
    if n != 2:
        return out
    out["zero1_all_reduce"] = train(rank, n, "zero1", reduce="all_reduce")
    overlaps = dict(bucket_cap_mb=SMALL, overlap_grad_reduce=True, overlap_param_gather=True)
    out["zero1_overlap"] = train(rank, n, "zero1", **overlaps)
    out["zero1_overlap_mixed"] = train(rank, n, "zero1", mixed_precision=True, **overlaps)
    out["zero1_overlap_accumulate"] = train(rank, n, "zero1", micro=2, **overlaps)
    out["zero2_overlap"] = train(rank, n, "zero2", bucket_cap_mb=SMALL, overlap_param_gather=True)
    for key, options in FP32_REDUCE.items():
        out[key] = train(rank, n, key.split("_")[0], mixed_precision=MAIN_GRADS, **options)
    for strategy in STAGES:
        out[f"{strategy}_mixed"] = train(rank, n, strategy, mixed_precision=True)
        out[f"{strategy}_clip"] = train(rank, n, strategy, clip=CLIP)
        out[f"{strategy}_accumulate"] = train(rank, n, strategy, micro=2)
    buckets = dict(prefetch_bucket_size=BUCKET, reduce_bucket_size=BUCKET)
    out["zero3_buckets_mixed"] = train(rank, n, "zero3", mixed_precision=True, **buckets)
    out["zero3_mixed_one_step_group"] = train(rank, n, "zero3", mixed_precision=True, sub_group_size=PSI)
    out["zero1_checkpointed"] = train(rank, n, "zero1", activation_checkpointing=True)
    out["zero2_checkpointed"] = train(rank, n, "zero2", activation_checkpointing=True)
    out["zero3_buckets_accumulate"] = train(rank, n, "zero3", micro=2, **buckets)
    out["torch_zero"] = peer_zero_redundancy(rank, n)
    out["torch_fsdp2"] = peer_fsdp2(rank, n)
    out["torch_fsdp2_fp32_reduce"] = peer_fsdp2(rank, n, dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    out["errors"] = errors(rank, n)
    return out


@functools.cache
def results(n):
    """Every rank's results for world size n (one launch); losses averaged over ranks."""
    ranks = toolkit.launch(run_rank, n, args=(n,), timeout_s=60, quiet=True)
    merged = ranks[0]
    for key, value in merged.items():
        if isinstance(value, dict) and "losses" in value:
            value["losses"] = [sum(r[key]["losses"][i] for r in ranks) / n for i in range(STEPS)]
            value["all_memory"] = [r[key].get("memory") for r in ranks]
    return merged


# --- parity with one process ---------------------------------------------------------------------------
@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", list(STAGES))
def test_parity_with_one_process(strategy, n):
    losses, _, params = oracle()
    got = results(n)
    for key in [strategy] + ([f"{strategy}_small"] if n > 1 and strategy != "zero3" else []):
        assert max(abs(a - b) for a, b in zip(got[key]["losses"], losses)) < ATOL, key
        assert max_diff(got[key]["params"], params) < ATOL, key


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", list(STAGES))
def test_mixed_precision_parity(strategy):
    losses, _, params = oracle(mixed=True)
    got = results(2)[f"{strategy}_mixed"]
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < MP_LOSS_ATOL
    diff = torch.cat([(got["params"][k] - params[k]).abs().flatten() for k in params])
    assert diff.max() < MP_PARAM_MAX and diff.mean() < MP_PARAM_MEAN and diff.quantile(0.99) < MP_PARAM_P99
    moved = torch.cat([(params[k] - v.detach()).abs().flatten() for k, v in build().named_parameters()])
    assert moved.mean() > 20 * MP_PARAM_MEAN  # the bound is far below what training moves


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", list(STAGES))
def test_clipping_uses_the_global_norm(strategy):
    losses, norms, params = oracle(clip=CLIP)
    got = results(2)[f"{strategy}_clip"]
    assert min(norms) > 2 * CLIP  # every step clipped
    assert max(abs(a - b) for a, b in zip(got["norms"], norms)) < 1e-5  # the true global norm
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < ATOL
    assert max_diff(got["params"], params) < ATOL


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", list(STAGES))
def test_gradient_accumulation(strategy):
    """Two micro-batches per step (ZeRO-1 under no_sync) take the full-batch step."""
    losses, _, params = oracle()
    got = results(2)[f"{strategy}_accumulate"]
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < ATOL
    assert max_diff(got["params"], params) < ATOL


@pytest.mark.timeout(150)
def test_all_reduce_variant_of_zero1():
    """reduce="all_reduce" gives the same training, at 3 passes over Ψ instead of 2."""
    losses, _, params = oracle()
    got = results(2)["zero1_all_reduce"]
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < ATOL
    assert max_diff(got["params"], params) < ATOL
    assert got["sent"] == 3 * got["padded"] * 4 // 2  # all-reduce 2(N-1)/N + all-gather (N-1)/N, N = 2


@pytest.mark.timeout(150)
def test_megatrons_overlaps_train_as_one_process_and_move_the_communication_into_the_passes():
    """overlap_grad_reduce (ZeRO-1) reduce-scatters each bucket during backward; overlap_param_gather (ZeRO-1 and 2)
    all-gathers the updated parameters bucket by bucket in the next forward, before each bucket's first module: the
    same training (fp32, bf16, two micro-batches under no_sync) and the same bytes, in the passes that hide them."""
    got = results(2)
    losses, _, params = oracle()
    for key in ("zero1_overlap", "zero1_overlap_accumulate", "zero2_overlap"):
        assert max(abs(a - b) for a, b in zip(got[key]["losses"], losses)) < ATOL, key
        assert max_diff(got[key]["params"], params) < ATOL, key
    mixed = got["zero1_overlap_mixed"]
    assert max(abs(a - b) for a, b in zip(mixed["losses"], got["zero1_mixed"]["losses"])) < 1e-6
    assert max_diff(mixed["params"], got["zero1_mixed"]["params"]) < 1e-6  # the same sums, in the same order
    # the last step's calls in order: without the overlaps, the reductions (blocking under ZeRO-1) after backward and
    # the gathers (blocking) after the step; with them, the gathers first (the forward's, asynchronous, a bucket
    # ahead), then the reductions (asynchronous, during backward)
    n = got["zero1_small"]["shards"]
    assert got["zero1_small"]["order"] == [("reduce_scatter", False)] * n + [("all_gather", False)] * n
    assert got["zero2_small"]["order"] == [("reduce_scatter", True)] * n + [("all_gather", False)] * n
    for key, plain in (("zero1_overlap", "zero1_small"), ("zero2_overlap", "zero2_small")):
        assert got[key]["sent"] == got[plain]["sent"], key  # the same bytes
        assert got[key]["order"] == [("all_gather", True)] * n + [("reduce_scatter", True)] * n, key
    assert "overlap_param_gather=True" in got["errors"]["stale state_dict"]
    assert "full_state_dict(model) on every rank" in got["errors"]["stale state_dict"]


# --- parity with torch's own ZeRO-1 and FSDP2 ------------------------------------------------------
@pytest.mark.timeout(150)
@pytest.mark.parametrize("ours, theirs", [("zero1", "torch_zero"), ("zero3", "torch_fsdp2")])
def test_parity_with_torch(ours, theirs):
    got = results(2)
    assert max(abs(a - b) for a, b in zip(got[ours]["losses"], got[theirs]["losses"])) < ATOL
    assert max_diff(got[ours]["params"], got[theirs]["params"]) < ATOL


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ours", [k for k in FP32_REDUCE if not k.endswith("accumulate")])
def test_gradients_reduced_in_fp32_train_as_fsdp2_with_the_same_policy(ours):
    """ZeRO-1 and ZeRO-2 with mixed_precision=dict(param_dtype="bf16", reduce_dtype="fp32") against torch's FSDP2 with
    MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): the same bf16 forward and backward, the same fp32
    average of two ranks' gradients (one addition and a halving), the same fp32 AdamW on the slices: the same losses
    and parameters to the bit. Reduced in bf16, the parameters differ (the average rounded to bf16)."""
    got = results(2)
    theirs = got["torch_fsdp2_fp32_reduce"]
    assert got[ours]["losses"] == theirs["losses"], ours
    assert max_diff(got[ours]["params"], theirs["params"]) == 0, ours
    assert max_diff(got["zero1_mixed"]["params"], theirs["params"]) > 1e-4  # the bf16 reduction: not FSDP2's policy


# --- memory: measured model states against the ZeRO formulas ------------------------------------------
CASES = [(n, s, False) for n in (1, 2, 3, 4) for s in STAGES] + [(2, s, True) for s in STAGES]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n, strategy, mixed", CASES)
def test_memory_matches_model_states(n, strategy, mixed):
    """After the optimizer step, before zero_grad: fp32 4+4+8 (AdamW's two moments, no separate master:
    the optimizer steps the slice itself), mixed 2+2+12 (fp32 master, momentum, variance).

    Measured = theory within the padding (< N elements per flat buffer, counted in every category it
    is in) plus AdamW's 4-byte step counter per shard.
    """
    got = results(n)[f"{strategy}_mixed" if mixed else strategy]
    p, g, k = (2, 2, 12) if mixed else (4, 4, 8)
    theory = model_states_breakdown(PSI, n, STAGES[strategy], param_bytes=p, grad_bytes=g, optimizer_multiplier=k)
    slack = {
        "params": got["padding"] * p,
        "grads": got["padding"] * g,
        "optimizer": got["padding"] * k / n + 4 * got["shards"],
    }
    for memory in got["all_memory"]:  # every rank
        for category, bytes_ in memory.items():
            assert 0 <= bytes_ - theory[category] <= slack[category] + 1e-9, (category, bytes_, theory[category])
    if strategy == "zero3":
        assert got["freed"]  # outside forward and backward: no gathered copy; the parameters, this rank's pieces


# --- communication: bytes this rank sent in one step --------------------------------------------------
@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", list(STAGES))
def test_bytes_on_the_wire(strategy, n):
    """ZeRO-1/2: reduce-scatter + all-gather = 2Ψ(N-1)/N; ZeRO-3: + the backward gather = 3Ψ(N-1)/N.
    Exact for the padded buffers; within the padding of the unpadded theory."""
    got = results(n)[strategy]
    passes = 3 if strategy == "zero3" else 2
    b = got["dtype_bytes"]
    assert got["sent"] == passes * got["padded"] * b * (n - 1) // n
    theory = communication_per_step(PSI, n, strategy) * b
    assert abs(got["sent"] - theory) <= passes * got["padding"] * b
    if n > 1 and strategy != "zero3":
        small = results(n)[f"{strategy}_small"]
        assert small["shards"] > 3 and small["sent"] == 2 * small["padded"] * b * (n - 1) // n


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_zero3_buckets_change_the_calls_not_the_training(n):
    """prefetch_bucket_size / reduce_bucket_size: the same training, bytes and model states, in fewer
    collectives (a step's first forward records the order; the later ones gather a bucket at a time)."""
    losses, _, params = oracle()
    plain, got = results(n)["zero3"], results(n)["zero3_buckets"]
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < ATOL
    assert max_diff(got["params"], params) < ATOL
    assert got["sent"] == plain["sent"] and got["all_memory"] == plain["all_memory"] and got["freed"]
    units = plain["shards"]
    assert plain["calls"] == {"all_gather": 2 * units, "reduce_scatter": units}
    assert got["calls"]["all_gather"] < units and got["calls"]["reduce_scatter"] < units / 2, got["calls"]


@pytest.mark.timeout(150)
def test_zero3_buckets_in_mixed_precision_and_with_accumulation():
    got = results(2)
    mixed, plain_mixed = got["zero3_buckets_mixed"], got["zero3_mixed"]
    assert max(abs(a - b) for a, b in zip(mixed["losses"], plain_mixed["losses"])) < ATOL
    assert max_diff(mixed["params"], plain_mixed["params"]) < ATOL  # 16-bit sums of two ranks: alike
    assert mixed["sent"] == plain_mixed["sent"] and mixed["all_memory"] == plain_mixed["all_memory"]
    losses, _, params = oracle()
    accumulated = got["zero3_buckets_accumulate"]
    assert max(abs(a - b) for a, b in zip(accumulated["losses"], losses)) < ATOL
    assert max_diff(accumulated["params"], params) < ATOL


@pytest.mark.timeout(150)
def test_zero3_sub_groups_change_the_step_not_the_training():
    """The optimizer steps one module's slice at a time (sub_group_size=0) or all at once: an elementwise
    update is the same either way, bit for bit (the memory it saves: tests/test_sim_memory.py)."""
    got = results(2)
    one, modules = got["zero3_mixed_one_step_group"], got["zero3_mixed"]
    assert one["losses"] == modules["losses"] and max_diff(one["params"], modules["params"]) == 0
    assert one["sent"] == modules["sent"] and one["all_memory"] == modules["all_memory"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_activation_checkpointing_trains_as_one_process(strategy):
    """activation_checkpointing=True is an option of every strategy (zero3 x tp: test_tensor_parallel.py):
    the blocks recompute their forward in backward, and the training is one process's."""
    losses, _, params = oracle()
    got = results(2)[f"{strategy}_checkpointed"]
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < ATOL
    assert max_diff(got["params"], params) < ATOL


@pytest.mark.timeout(150)
@pytest.mark.parametrize("key", list(FP32_REDUCE))
def test_gradients_reduced_in_fp32(key):
    """mixed_precision=dict(param_dtype="bf16", reduce_dtype="fp32"): each backward's bf16 gradients added into fp32
    main gradients, which are reduced: the bf16 recipe's training (with micro-batches accumulated in fp32 too), the
    reduction's bytes at 4 a value and the all-gather's at 2, and 4 bytes of gradient a parameter."""
    losses, _, params = oracle(mixed=True)
    got, n = results(2)[key], 2
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < MP_LOSS_ATOL
    diff = torch.cat([(got["params"][k] - params[k]).abs().flatten() for k in params])
    assert diff.max() < MP_PARAM_MAX and diff.mean() < MP_PARAM_MEAN and diff.quantile(0.99) < MP_PARAM_P99
    reduce_passes = 2 if "all_reduce" in key else 1  # an all-reduce is 2(N-1)/N, a reduce-scatter (N-1)/N
    if key == "zero2_fp32_reduce_accumulate":  # ZeRO-2 reduce-scatters each micro-batch's gradients
        reduce_passes = 2
    assert got["dtype_bytes"] == 2
    assert got["sent"] == (reduce_passes * 4 + 2) * got["padded"] * (n - 1) // n
    stage = STAGES[key.split("_")[0]]
    theory = model_states_breakdown(PSI, n, stage, param_bytes=2, grad_bytes=4, optimizer_multiplier=12)
    for memory in got["all_memory"]:
        assert 0 <= memory["grads"] - theory["grads"] <= got["padding"] * 4, (memory["grads"], theory["grads"])


@pytest.mark.timeout(150)
def test_mixed_precision_halves_the_bytes():
    got = results(2)
    for strategy in STAGES:
        assert got[f"{strategy}_mixed"]["sent"] * 2 == got[strategy]["sent"]


# --- misuse -------------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_errors_on_ranks():
    found = results(2)["errors"]
    assert "different models" in found["mismatch"]
    assert "zero_grad" in found["zero1_twice"] and "no_sync" in found["zero1_twice"]
    assert "no_sync" in found["zero1_no_sync_only"]
    assert "zero_grad" in found["zero1_overlap_twice"]  # reduced during the first backward already
    assert "overlap_grad_reduce must be True or False, got 'yes'" in found["overlap not a bool"]
    assert "overlap_param_gather" in found["overlap on zero3"] and "valid options" in found["overlap on zero3"]


@pytest.mark.timeout(150)
def test_forward_gives_the_unwrapped_models_outputs():
    """model(x) after training equals a plain GPT holding the full_state_dict() parameters."""
    for n, key in [(1, "zero1"), (2, "zero2"), (3, "zero3"), (4, "zero3")]:
        got = results(n)[key]
        plain = build()
        plain.load_state_dict(got["params"], strict=False)  # the head is the embedding: tied
        with torch.no_grad():
            expected = plain(batches(0, 1, steps=1)[0][0])
        assert (got["logits"] - expected).abs().max() < ATOL, (n, key)


@pytest.mark.timeout(150)
def test_scheduler_and_state_dict():
    got = results(1)["scheduler"]
    assert got["lr"] == LR / 2  # StepLR changed the inner optimizer's learning rate
    assert got["states"] == 1 and got["moment"] == (PSI,)  # one slice (one bucket), whole model at N = 1


@pytest.mark.timeout(150)
def test_sharding_over_a_subgroup():
    losses, _, params = oracle()
    got = results(4)["zero3_group"]
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < ATOL
    assert max_diff(got["params"], params) < ATOL
    assert got["sent"] == 3 * got["padded"] * 4 // 2  # the group of 2 is the world here


@pytest.mark.parametrize("strategy", list(STAGES))
def test_bad_options_and_optimizers(strategy):
    with pytest.raises(ValueError, match="valid options"):
        wrap(build(), strategy, optimizer=OPT, bucket_size=3)
    with pytest.raises(ValueError, match="elementwise"):
        wrap(build(), strategy, optimizer=torch.optim.LBFGS)
    with pytest.raises(ValueError, match="mixed_precision"):
        wrap(build(), strategy, optimizer=OPT, mixed_precision="fp8")
    with pytest.raises(RuntimeError, match="toolkit.launch"):  # no process group: even one rank needs one
        wrap(build(), strategy, optimizer=OPT)


def test_bad_stage_options():
    with pytest.raises(ValueError, match="zero3: mixed_precision's reduce_dtype.*use fsdp"):
        wrap(build(), "zero3", optimizer=OPT, mixed_precision=MAIN_GRADS)
    with pytest.raises(ValueError, match="unknown keys.*param_dtype, reduce_dtype"):
        wrap(build(), "zero1", optimizer=OPT, mixed_precision=dict(grad_dtype="fp32"))
    with pytest.raises(ValueError, match="reduce"):
        wrap(build(), "zero1", optimizer=OPT, reduce="broadcast")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        wrap(build(), "zero2", optimizer=OPT, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="valid options"):
        wrap(build(), "zero3", optimizer=OPT, bucket_cap_mb=1)  # stage 3's buckets are DeepSpeed's, below
    with pytest.raises(ValueError, match="valid options"):
        wrap(build(), "zero2", optimizer=OPT, prefetch_bucket_size=10)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="number of elements"):
            wrap(build(), "zero3", optimizer=OPT, reduce_bucket_size=bad)
        with pytest.raises(ValueError, match="sub_group_size is a number of elements"):
            wrap(build(), "zero3", optimizer=OPT, sub_group_size=bad)
    with pytest.raises(ValueError, match="valid options"):
        wrap(build(), "zero2", optimizer=OPT, sub_group_size=10)
    with pytest.raises(ValueError, match="could not build"):
        wrap(build(), "zero2", optimizer=lambda params: None.step)


# --- flat buffers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_flat_buffer_layout_and_padding(world_size):
    tensors = [torch.randn(5), torch.randn(3, 1), torch.randn(2, 3, 1)]  # 14 elements
    flat = FlatBuffer.of(tensors, world_size)
    assert flat.numel == 14 and flat.padded_numel % world_size == 0
    assert 0 <= flat.padding < world_size and flat.padded_numel == padded_numel(14, world_size)
    for t, view in zip(tensors, flat.views()):
        assert view.shape == t.shape and torch.equal(view, t)
        assert view.untyped_storage().data_ptr() == flat.data.untyped_storage().data_ptr()
    assert torch.all(flat.data[flat.numel :] == 0)
    shards = [flat.shard(r) for r in range(world_size)]
    assert torch.equal(torch.cat(shards), flat.data)
    # pieces: every element of every tensor is in exactly one rank's shard, where the layout says
    covered = [torch.zeros(n, dtype=torch.int) for n in flat.numels]
    for r in range(world_size):
        for piece in flat.pieces(r):
            covered[piece.index][piece.tensor_start : piece.tensor_end] += 1
            assert torch.equal(
                shards[r][piece.shard_start : piece.shard_end],
                tensors[piece.index].reshape(-1)[piece.tensor_start : piece.tensor_end],
            )
            assert r in flat.owners(piece.index)
    assert all(torch.all(c == 1) for c in covered)


def test_flat_buffer_free_keeps_views():
    flat = FlatBuffer.of([torch.ones(2, 2), torch.ones(3)], 2)
    view = flat.view(0)
    flat.free()
    assert not flat.is_allocated and view.untyped_storage().nbytes() == 0 and view.shape == (2, 2)
    flat.allocate()
    flat.data.fill_(7)
    assert flat.is_allocated and torch.all(view == 7)


def test_model_shape_divides_by_neither_3_nor_4():
    assert build().num_params() == PSI and PSI % 3 and PSI % 4
