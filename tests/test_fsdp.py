"""FSDP checked against one process, against torch's FSDP2, against the paper's traffic and memory
bounds, through its checkpoints, and on bad input.

Every rank trains on its contiguous slice of the same global batch, so FSDP must reproduce a plain
one-process torch loop (AdamW on the whole batch). Each world size is one launch (`results(n)`,
cached) that runs every check for that size; the tests only compare the numbers it brought back.
World 2 carries most variants; world 4 also runs hybrid sharding (2 x 2) and loads the checkpoint
world 2 wrote (a different world size).

The model is test_zero's tiny GPT (Ψ = 19,006, tied head): units (root 2,106 = embeddings + final
norm; two blocks of 8,450) pad at world sizes 3 and 4.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile

import pytest
import torch
import torch.nn as nn
from oracle import plain_training

import toolkit
from toolkit.memory import communication_per_step
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel import checkpoint as ckpt
from toolkit.parallel import wrap
from toolkit.parallel.fsdp import FSDPUnit, MixedPrecision, initialize, seeded_init
from toolkit.parallel.fsdp_policy import plan
from toolkit.runtime import env

CFG = dict(vocab_size=63, d_model=26, n_head=2, seq_len=16)
PSI, ROOT, BLOCK = 19006, 2106, 8450
STEPS, GLOBAL_BATCH, LR = 4, 12, 1e-3
OPT = functools.partial(torch.optim.AdamW, lr=LR)
ATOL = 1e-5
CLIP = 0.05
MP_LOSS_ATOL, MP_PARAM_MAX, MP_PARAM_MEAN, MP_PARAM_P99 = 3 / 32, 2 * LR * STEPS, 1e-4, 5e-4  # as test_zero
BIG = dict(CFG, n_layer=8)  # deferred initialization: Ψ = 69,706


def build(seed=0, **overrides):
    torch.manual_seed(seed)
    return tiny_gpt(**{**CFG, **overrides})


def batches(rank=0, world_size=1, steps=STEPS, first=0):
    corpus = SyntheticCorpus(vocab_size=63, seq_len=16)
    return [corpus.batch(s, GLOBAL_BATCH, rank=rank, world_size=world_size) for s in range(first, first + steps)]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def ckpt_diff(a: dict, b: dict) -> float:
    """Largest difference between two full checkpoints, parameters and optimizer state (same keys)."""
    assert a["model"].keys() == b["model"].keys() and a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    diffs = [max_diff(a["model"], b["model"])]
    for name, state in a["optimizer"]["state"].items():
        diffs.append(
            max_diff(
                {k: torch.as_tensor(v) for k, v in state.items()},
                {k: torch.as_tensor(v) for k, v in b["optimizer"]["state"][name].items()},
            )
        )
    return max(diffs)


@functools.cache
def oracle(clip=None, mixed=False, model=None):
    """Losses, clip norms and final parameters of one process on the whole batch, torch only."""
    net = build() if model is None else initialize(tiny_gpt(**dict(model)), seeded_init(0))
    return plain_training(net, batches(), OPT, clip=clip, mixed=mixed)


@functools.cache
def accumulated_oracle(n, model):
    """One process doing the ranks' arithmetic in their order: each rank's rows' mean loss, divided by n, backward
    (a sum of two gradients is the same in either order, and halving is exact), then AdamW; one thread, as each
    rank has. Its losses and parameters equal FSDP's at world 2 to the bit: there is no tolerance to guess (the
    whole batch at once sums in another order: 1.8e-5 apart after 4 steps, AdamW magnifying the last bits of
    gradients near zero)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = initialize(tiny_gpt(**dict(model)), seeded_init(0))
        opt, losses = OPT(net.parameters()), []
        for step in range(STEPS):
            parts = []
            for rank in range(n):
                ((x, y),) = batches(rank, n, steps=1, first=step)
                loss = net(x, y)
                (loss / n).backward()
                parts.append(loss.item())
            opt.step()
            opt.zero_grad()
            losses.append(sum(parts) / n)  # as results() averages the ranks' losses
        return losses, {k: v.detach().clone() for k, v in net.named_parameters()}
    finally:
        torch.set_num_threads(threads)


# --- what every rank runs ------------------------------------------------------------------------------
def train(rank, n, *, clip=None, micro=1, no_sync=False, track=False, model=None, **options):
    """The plain loop on this rank's rows. On the last step it records the collectives and FSDP spans
    (name, unit, phase), the bytes sent, and memory at every gather/free/reduction (ledger + activations).
    With `track`, torch's MemTracker measures every allocation from wrap to the end (the true peak)."""
    from toolkit.memory import ActivationMeter, ledger
    from toolkit.trace import recorder
    from toolkit.trace.events import current_phase, phase

    tracker = contextlib.nullcontext()
    if track:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
    with tracker:
        model, opt = wrap(build() if model is None else model, "fsdp", optimizer=OPT, **options)
        meter, samples = ActivationMeter(model), []

        def probe(event, unit):
            m = ledger(model, opt)
            samples.append((m["params"] + m["grads"] + m["optimizer"], meter.live, current_phase()))

        losses, norms = [], []
        for step, (x, y) in enumerate(batches(rank, n)):
            last = step == STEPS - 1
            start = len(recorder.events)
            meter.reset_peak()
            if track:
                tracker.reset_mod_stats()  # its per-module statistics are per iteration; the peak stays
            with model.watch_memory(probe=probe) if last else contextlib.nullcontext():
                rows, loss = x.shape[0] // micro, 0.0
                for i in range(micro):
                    quiet = no_sync and i < micro - 1
                    with model.no_sync() if quiet else contextlib.nullcontext():
                        with phase("forward"), meter:
                            part = model(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) / micro
                        with phase("backward"):
                            part.backward()
                    loss = loss + part.detach()
                if clip is not None:
                    norms.append(model.clip_grad_norm_(clip).item())
                opt.step()
            if last:
                events = recorder.events[start:]
                trace = [(e["name"], e["args"].get("unit"), e["phase"]) for e in events if e["cat"] in ("comm", "fsdp")]
                sent = sum(e["args"]["bytes_sent"] for e in events if e["cat"] == "comm")
            opt.zero_grad()
            losses.append(loss.float().item())
    with torch.no_grad():
        logits = model(batches(0, 1, steps=1)[0][0]).float()
    out = {
        "losses": losses,
        "norms": norms,
        "params": model.full_state_dict(),
        "trace": trace,
        "sent": sent,
        "units": model.describe(),
        "states_peak": max(s[0] for s in samples),
        "forward_peak": max(s[0] for s in samples if s[2] == "forward"),
        "activations_peak": meter.peak,
        "logits": logits,
        "shard_bytes": sum(t.untyped_storage().nbytes() for t in model.memory_groups()["optimizer"]),
    }
    if track:
        out["tracked_peak"] = tracker.get_tracker_snapshot("peak")[env.device()]["Total"]
    return out


def peer_fsdp2(rank, n):
    """torch's FSDP2 on the same model and units: fully_shard on every block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build().to(env.device())
    mesh = init_device_mesh(env.device().type, (n,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = OPT(model.parameters())
    losses = []
    for x, y in batches(rank, n):
        loss = model(x.to(env.device()), y.to(env.device()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {k: v.full_tensor().cpu().detach().clone() for k, v in model.named_parameters()},
    }


def steps(model, opt, rank, n, first, count=2):
    losses = []
    for x, y in batches(rank, n, steps=count, first=first):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def checkpoints(rank, n, tmp):
    """World 2: train, save full and sharded, reload into FSDP and into every other strategy, and back."""
    out = {}
    model, opt = wrap(build(), "fsdp", optimizer=OPT)
    steps(model, opt, rank, n, 0, STEPS)
    ckpt.save_full(model, opt, f"{tmp}/fsdp-w2.pt")
    ckpt.save_sharded(model, opt, f"{tmp}/sharded-w2")
    reference = ckpt.full_checkpoint(model, opt, rank0_only=False)
    out["resumed"] = steps(model, opt, rank, n, STEPS)  # two more steps, as if never interrupted
    fresh, fresh_opt = wrap(build(seed=1), "fsdp", optimizer=OPT)  # other values: loading must replace them
    ckpt.load_sharded(fresh, fresh_opt, f"{tmp}/sharded-w2")
    out["sharded"] = ckpt_diff(reference, ckpt.full_checkpoint(fresh, fresh_opt, rank0_only=False))
    out["sharded_resumed"] = steps(fresh, fresh_opt, rank, n, STEPS)
    for strategy in ("zero1", "zero2", "zero3", "ddp"):
        other, other_opt = wrap(build(seed=1), strategy, optimizer=OPT)
        ckpt.load_full(other, other_opt, f"{tmp}/fsdp-w2.pt")
        out[f"into_{strategy}"] = ckpt_diff(reference, ckpt.full_checkpoint(other, other_opt, rank0_only=False))
        if strategy == "zero2":  # and back: zero2's full checkpoint into a fresh FSDP
            ckpt.save_full(other, other_opt, f"{tmp}/zero2-w2.pt")
            back, back_opt = wrap(build(seed=2), "fsdp", optimizer=OPT)
            ckpt.load_full(back, back_opt, f"{tmp}/zero2-w2.pt")
            out["back_from_zero2"] = ckpt_diff(reference, ckpt.full_checkpoint(back, back_opt, rank0_only=False))
    out["reference"] = reference
    return out


def errors(rank, n, tmp):
    """Misuse on real ranks: each raises a clear error on every rank (no hang), and loads nothing."""
    found = {}

    def catch(key, fn):
        try:
            fn()
        except (ValueError, RuntimeError) as exc:
            found[key] = f"{type(exc).__name__}: {exc}"

    catch("group_size", lambda: wrap(build(), "fsdp", optimizer=OPT, sharding_group_size=3))
    with torch.device("meta"):
        meta = tiny_gpt(**CFG)
    catch("meta_without_init", lambda: wrap(meta, "fsdp", optimizer=OPT))
    path = f"{tmp}/fsdp-w2.pt"
    if rank == 0:
        with open(path, "rb") as f, open(f"{tmp}/corrupt.pt", "wb") as g:
            g.write(f.read()[:2000])
    torch.distributed.barrier()
    for key, overrides, file in [
        ("shapes", dict(d_model=28), path),
        ("another_model", dict(n_layer=3), path),
        ("corrupt", {}, f"{tmp}/corrupt.pt"),
        ("missing", {}, f"{tmp}/nothing.pt"),
    ]:
        model, opt = wrap(build(seed=5, **overrides), "fsdp", optimizer=OPT)
        before = model.full_state_dict()
        catch(key, functools.partial(ckpt.load_full, model, opt, file))
        found[f"{key}_unchanged"] = max_diff(before, model.full_state_dict()) == 0 and not opt.state
    model, opt = wrap(build(), "fsdp", optimizer=functools.partial(torch.optim.SGD, lr=LR))
    catch("optimizer_kind", lambda: ckpt.load_full(model, opt, path))
    model, opt = wrap(build(), "fsdp", optimizer=OPT)
    ((x, y),) = batches(rank, n, steps=1)

    def only_no_sync():
        with model.no_sync():
            model(x, y).backward()
        opt.step()

    catch("no_sync_only", only_no_sync)
    for strategy in ("fsdp", "zero3"):  # between steps the parameters are this rank's pieces: readable, not saved
        model, opt = wrap(build(), strategy, optimizer=OPT)
        model(x, y).backward()
        opt.step()
        params = dict(model.module.named_parameters())
        sums = torch.stack([p.detach().sum() for p in params.values()])  # read freed memory before ParamViews
        torch.distributed.all_reduce(sums)
        full = model.full_state_dict()
        found[f"{strategy} pieces add up"] = torch.allclose(
            sums, torch.stack([full[n].sum() for n in params]), atol=1e-5
        )
        found[f"{strategy} pieces"] = sum(p.numel() for p in params.values())
        model(x, y).backward()  # and training goes on from them
        opt.step()
        catch(f"{strategy} state_dict", model.state_dict)
        catch(f"{strategy} block state_dict", model.module.blocks[0].state_dict)
        names = sorted(name for name, _ in build().named_parameters())
        found[f"{strategy} full_state_dict"] = sorted(model.full_state_dict()) == names
    return found


def deferred(rank, n):
    """Build on the meta device, shard, materialize unit by unit; measure the peak with MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        with torch.device("meta"):
            model = tiny_gpt(**BIG)
        model, opt = wrap(model, "fsdp", optimizer=OPT, param_init_fn=seeded_init(0))
        peak = tracker.get_tracker_snapshot("peak")[env.device()]["Total"]
    initial = model.full_state_dict()
    return {
        "peak": peak,
        "initial": initial,
        "losses": steps(model, opt, rank, n, 0, STEPS),
        "params": model.full_state_dict(),
        "units": model.describe(),
    }


class PlainUnit(FSDPUnit):
    """What the lab asks for: a unit's unshard and reshard written again, from its attributes only
    (a blocking all-gather: no prefetch can overlap it). Plugged in with unit_class=PlainUnit."""

    def unshard(self, async_op=False):
        if self.state == "sharded":
            self.flat.allocate()
            piece = self.master.detach().to(self.flat.data.dtype)
            toolkit.comm.all_gather(self.flat.data, piece, group=self.sharding.shard_group)
            self.state = "gathered"

    def reshard(self):
        self.flat.free()
        self.state = "sharded"


def watched(rank, n):
    """model.watch_memory(): a ledger sample in the trace at every gather, free and reduction."""
    from toolkit.trace import recorder

    model, opt = wrap(build(), "fsdp", optimizer=OPT)
    ((x, y),) = batches(rank, n, steps=1)
    start = len(recorder.samples)
    with model.watch_memory(step=0):
        model(x, y).backward()
        opt.step()
    return [(s["event"], s["params"], s["grads"]) for s in recorder.samples[start:]]


VARIANTS_2 = {
    "prefetch_off": dict(backward_prefetch=False),
    "prefetch_all": dict(forward_prefetch=True, track=True),
    "keep": dict(reshard_after_forward=False, track=True),
    "ac": dict(activation_checkpointing=True, track=True),
    "ac_prefetch": dict(activation_checkpointing=True, forward_prefetch=True),
    "ac_every_2": dict(activation_checkpointing=2, track=True),  # the second block of two
    "ac_op": dict(activation_checkpointing="op", track=True),  # every block by operation (checkpoint_ops.py)
    "tied_policy": dict(wrap_policy=["tok_emb", "blocks.0", "blocks.1"]),
    "nested_policy": dict(wrap_policy=["blocks.0", "blocks.0.mlp", "blocks.1"]),
    "size_policy": dict(wrap_policy=3000),
    "one_shard_group": dict(sharding_group_size=1),
    "plain_unit": dict(unit_class=PlainUnit, forward_prefetch=True),
}


def run_rank(n, tmp):
    rank = torch.distributed.get_rank()
    out = {"fsdp": train(rank, n, track=n == 2), "prefetch_all": train(rank, n, forward_prefetch=True)}
    if n == 2:
        out.update({k: train(rank, n, **v) for k, v in VARIANTS_2.items()})
        out["mixed"] = train(rank, n, mixed_precision=True)
        out["mixed_fp32_reduce"] = train(rank, n, mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
        out["clip"] = train(rank, n, clip=CLIP)
        out["accumulate"] = train(rank, n, micro=2)
        out["accumulate_no_sync"] = train(rank, n, micro=2, no_sync=True)
        out["torch_fsdp2"] = peer_fsdp2(rank, n)
        out["checkpoints"] = checkpoints(rank, n, tmp)
        out["errors"] = errors(rank, n, tmp)
        out["deferred"] = deferred(rank, n)
        out["watched"] = watched(rank, n)
    if n == 3:
        out["prefetch_off"] = train(rank, n, backward_prefetch=False)
    if n == 4:
        out["hsdp"] = train(rank, n, sharding_group_size=2)
        out["hsdp_prefetch"] = train(rank, n, sharding_group_size=2, forward_prefetch=True)
        out["hsdp_ac"] = train(rank, n, sharding_group_size=2, activation_checkpointing=True)
        out["hsdp_clip"] = train(rank, n, sharding_group_size=2, clip=CLIP)
        found = {}
        try:
            wrap(build(), "fsdp", optimizer=OPT, sharding_group_size=3)
        except ValueError as exc:
            found["group_size"] = str(exc)
        model, opt = wrap(build(seed=3), "fsdp", optimizer=OPT)
        try:
            ckpt.load_sharded(model, opt, f"{tmp}/sharded-w2")
        except ValueError as exc:
            found["sharded_other_world"] = str(exc)
        found["sharded_unchanged"] = not opt.state
        for key, options in [("w4", {}), ("w4_hsdp", dict(sharding_group_size=2))]:
            model, opt = wrap(build(seed=3), "fsdp", optimizer=OPT, **options)
            ckpt.load_full(model, opt, f"{tmp}/local.pt")  # FSDP (world 2) -> local -> FSDP (world 4)
            found[key] = ckpt.full_checkpoint(model, opt, rank0_only=False)
            found[f"{key}_resumed"] = steps(model, opt, rank, n, STEPS)
            if key == "w4":
                ckpt.save_sharded(model, opt, f"{tmp}/sharded-w4")
        try:  # same world size, another layout: hybrid shards are halves, not quarters
            ckpt.load_sharded(model, opt, f"{tmp}/sharded-w4")
        except ValueError as exc:
            found["sharded_other_layout"] = str(exc)
        out["checkpoints"] = found
    return out


@functools.cache
def results(n):
    """Every rank's results for world size n (one launch); losses averaged over ranks."""
    if n == 4:
        local_checkpoint()  # world 4 loads what world 2 wrote, through "local"
    ranks = toolkit.launch(run_rank, n, args=(n, tmp_dir()), timeout_s=100, quiet=True)
    merged = ranks[0]
    for key, value in merged.items():
        if isinstance(value, dict) and "losses" in value:
            value["losses"] = [sum(r[key]["losses"][i] for r in ranks) / n for i in range(len(value["losses"]))]
            value["every_rank"] = [r[key] for r in ranks]
    for key in ("resumed", "sharded_resumed", "w4_resumed", "w4_hsdp_resumed"):
        if key in merged.get("checkpoints", {}):
            merged["checkpoints"][key] = [sum(r["checkpoints"][key][i] for r in ranks) / n for i in range(2)]
    return merged


@functools.cache
def tmp_dir() -> str:
    """One folder for the whole session, made here and handed to the ranks (each imports this file anew)."""
    path = tempfile.mkdtemp(prefix="toolkit-fsdp-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def local_checkpoint():
    """In this process, no ranks: world 2's FSDP checkpoint into "local", compared, saved again."""
    results(2)
    model, opt = wrap(build(seed=1), "local", optimizer=OPT)
    ckpt.load_full(model, opt, f"{tmp_dir()}/fsdp-w2.pt")
    loaded = ckpt.full_checkpoint(model, opt)
    ckpt.save_full(model, opt, f"{tmp_dir()}/local.pt")
    return loaded


# --- parity with one process ---------------------------------------------------------------------------
def assert_parity(got, oracle_result=None, atol=ATOL):
    losses, _, params = oracle_result or oracle()
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < atol
    assert max_diff(got["params"], params) < atol


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_parity_with_one_process(n):
    """Default (backward prefetch), both prefetches, and no prefetch at all, at world sizes 2, 3, 4."""
    got = results(n)
    for key in ("fsdp", "prefetch_all", "prefetch_off"):
        if key in got:
            assert_parity(got[key])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("key", list(VARIANTS_2))
def test_variants_parity(key):
    """Without resharding after forward, with activation checkpointing, other wrap policies, F = 1."""
    assert_parity(results(2)[key])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("key", ["hsdp", "hsdp_prefetch", "hsdp_ac"])
def test_hybrid_sharding_parity(key):
    """World 4 as 2 shard groups x 2 replicas."""
    assert_parity(results(4)[key])


@pytest.mark.timeout(150)
def test_parity_with_fsdp2():
    got = results(2)
    theirs = got["torch_fsdp2"]
    assert max(abs(a - b) for a, b in zip(got["fsdp"]["losses"], theirs["losses"])) < ATOL
    assert max_diff(got["fsdp"]["params"], theirs["params"]) < ATOL


@pytest.mark.timeout(150)
@pytest.mark.parametrize("key", ["mixed", "mixed_fp32_reduce"])
def test_mixed_precision(key):
    """bf16 compute against the same recipe in one process (tolerances as in test_zero); fp32 masters."""
    losses, _, params = oracle(mixed=True)
    got = results(2)[key]
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < MP_LOSS_ATOL
    diff = torch.cat([(got["params"][k] - params[k]).abs().flatten() for k in params])
    assert diff.max() < MP_PARAM_MAX and diff.mean() < MP_PARAM_MEAN and diff.quantile(0.99) < MP_PARAM_P99
    # bytes: all-gathers in bf16; the reduce-scatter in bf16 or fp32
    padded = sum(u["padded_numel"] for u in got["units"])
    rs_bytes = 2 if key == "mixed" else 4
    assert got["sent"] == (2 * 2 + rs_bytes) * padded // 2


@pytest.mark.timeout(150)
def test_clipping_uses_the_global_norm():
    losses, norms, params = oracle(clip=CLIP)
    got = results(2)["clip"]
    assert min(norms) > 2 * CLIP
    assert max(abs(a - b) for a, b in zip(got["norms"], norms)) < 1e-5
    assert_parity(got, oracle(clip=CLIP))


@pytest.mark.timeout(150)
def test_clipping_with_hybrid_sharding():
    """Replicas hold the same averaged slice, so the shard group's slices make up the whole gradient."""
    losses, norms, params = oracle(clip=CLIP)
    got = results(4)["hsdp_clip"]
    assert max(abs(a - b) for a, b in zip(got["norms"], norms)) < 1e-5
    assert_parity(got, oracle(clip=CLIP))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("key, reduce_scatters", [("accumulate", 2), ("accumulate_no_sync", 1)])
def test_gradient_accumulation(key, reduce_scatters):
    """Two micro-batches take the full-batch step; under no_sync() the first one does not communicate."""
    got = results(2)[key]
    assert_parity(got)
    for unit in got["units"]:
        ops = [name for name, u, _ in got["trace"] if u == unit["unit"]]
        assert ops.count("reduce_scatter") == reduce_scatters


@pytest.mark.timeout(150)
def test_forward_gives_the_unwrapped_models_outputs():
    for n, key in [(2, "fsdp"), (3, "prefetch_all"), (4, "hsdp")]:
        got = results(n)[key]
        plain = build()
        plain.load_state_dict(got["params"], strict=False)
        with torch.no_grad():
            expected = plain(batches(0, 1, steps=1)[0][0])
        assert (got["logits"] - expected).abs().max() < ATOL


# --- the units --------------------------------------------------------------------------------------------
def test_default_policy_units_and_the_tied_weight():
    """Default: root (embeddings + final norm + the tied head) and each block; nothing moved."""
    units = plan(build())
    assert [u.name for u in units] == ["", "blocks.0", "blocks.1"]
    assert [sum(p.numel() for p in u.params) for u in units] == [ROOT, BLOCK, BLOCK]
    model = build()
    assert any(p is model.head.weight for p in plan(model)[0].params)


def test_policies():
    model = build()
    tied = plan(model, ["tok_emb", "blocks.0", model.blocks[1]])  # tok_emb's unit loses the tied weight
    assert [u.name for u in tied] == ["", "blocks.0", "blocks.1"]
    assert tied[0].moved_in == [("tok_emb.weight", ["", "tok_emb"])]
    assert [u.name for u in plan(model, 3000)] == ["", "blocks.0.mlp", "blocks.1.mlp"]  # not the ModuleList
    assert [u.name for u in plan(model, lambda name, m: name == "blocks.1")] == ["", "blocks.1"]
    assert [u.name for u in plan(model, nn.LayerNorm)][1:] == [f"blocks.{i}.ln_{j}" for i in (0, 1) for j in (1, 2)] + [
        "ln_f"
    ]
    nested = plan(model, ["blocks.0", "blocks.0.mlp"])
    assert [sum(p.numel() for p in u.params) for u in nested] == [ROOT + BLOCK, BLOCK - 5538, 5538]


@pytest.mark.timeout(150)
def test_tied_weight_moves_to_the_lowest_common_ancestor():
    units = results(2)["tied_policy"]["units"]
    assert [u["unit"] for u in units] == ["(root)", "blocks.0", "blocks.1"]
    assert units[0]["moved_in"] == ["tok_emb.weight"] and "tok_emb.weight" in units[0]["params"]


# --- communication ------------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_two_all_gathers_and_one_reduce_scatter_per_unit(n):
    """Per step, every unit: all-gather in forward, again in backward, one reduce-scatter: 3Ψ(N-1)/N."""
    got = results(n)["fsdp"]
    for unit in got["units"]:
        ops = [name for name, u, _ in got["trace"] if u == unit["unit"] and name in ("all_gather", "reduce_scatter")]
        assert sorted(ops) == ["all_gather", "all_gather", "reduce_scatter"], unit["unit"]
    padded = sum(u["padded_numel"] for u in got["units"])
    assert got["sent"] == 3 * padded * 4 * (n - 1) // n
    assert abs(got["sent"] - communication_per_step(PSI, n, "fsdp") * 4) <= 3 * (padded - PSI) * 4


@pytest.mark.timeout(150)
def test_traffic_of_the_variants():
    got = results(2)
    padded = sum(u["padded_numel"] for u in got["fsdp"]["units"])
    assert got["keep"]["sent"] == 2 * padded * 4 // 2  # no second all-gather: 2Ψ(N-1)/N
    assert got["ac"]["sent"] == got["fsdp"]["sent"]  # recomputation gathers nothing more
    hsdp = results(4)["hsdp"]  # shard groups of 2: 3 passes at (F-1)/F, then the slice all-reduced over 2
    padded4 = sum(u["padded_numel"] for u in hsdp["units"])
    assert hsdp["sent"] == 3 * padded4 * 4 // 2 + 2 * (padded4 // 2) * 4 // 2
    for unit in hsdp["units"]:
        assert [name for name, u, _ in hsdp["trace"] if u == unit["unit"]].count("all_reduce") == 1


@pytest.mark.timeout(150)
def test_prefetch_shows_in_the_trace():
    """forward_prefetch: block 1's all-gather is issued before block 0 computes; backward_prefetch:
    block 0's all-gather is issued before block 1's reduce-scatter. Without them, after."""

    def position(trace, name, unit, phase):
        return next(i for i, (n, u, p) in enumerate(trace) if (n, u, p) == (name, unit, phase))

    got = results(2)
    for key, forward, backward in [("prefetch_all", True, True), ("fsdp", False, True), ("prefetch_off", False, False)]:
        trace = got[key]["trace"]
        gather_1 = position(trace, "all_gather", "blocks.1", "forward")
        assert (gather_1 < position(trace, "forward blocks.0", "blocks.0", "forward")) == forward, key
        gather_0 = [i for i, (n, u, p) in enumerate(trace) if (n, u, p) == ("all_gather", "blocks.0", "backward")][0]
        assert (gather_0 < position(trace, "reduce_scatter", "blocks.1", "backward")) == backward, key


# --- memory ---------------------------------------------------------------------------------------------
def bound(units, n, in_flight):
    """The FSDP paper's bound on model states, fp32 AdamW: every shard (4 + 4 + 8 bytes per element,
    plus AdamW's step counters), plus what is whole: the root (it encloses every block: gathered all
    step, and its full gradient during backward), `in_flight` blocks gathered, and two blocks' full
    gradients (one filling, one being reduce-scattered)."""
    sharded = sum(u["padded_numel"] for u in units) // n * 16 + 4 * len(units)
    block = max(u["padded_numel"] for u in units[1:]) * 4
    return sharded + 2 * units[0]["padded_numel"] * 4 + (in_flight + 2) * block


@pytest.mark.timeout(150)
def test_memory_within_the_paper_bound():
    got = results(2)
    units = got["fsdp"]["units"]
    for key, in_flight in [("fsdp", 2), ("prefetch_off", 1), ("prefetch_all", 2), ("ac", 2)]:
        for rank in got[key]["every_rank"]:
            assert rank["states_peak"] <= bound(units, 2, in_flight), key
            sharded = sum(u["padded_numel"] for u in units) // 2 * 16
            assert rank["states_peak"] > sharded + (ROOT + BLOCK) * 4  # the root and a block were whole
    # forward prefetching holds one more block in forward
    assert got["prefetch_all"]["forward_peak"] - got["fsdp"]["forward_peak"] == BLOCK * 4
    # without resharding after forward, every unit is whole at the end of forward
    padded = sum(u["padded_numel"] for u in units)
    assert got["keep"]["forward_peak"] - got["fsdp"]["forward_peak"] == (padded - ROOT - BLOCK) * 4
    # the measured peak of everything (MemTracker, wrap to end): model states + activations + temporaries.
    # Activation checkpointing recomputes one block's activations inside backward: add them.
    recomputed = (got["fsdp"]["activations_peak"] - got["ac"]["activations_peak"]) / 2
    for key, extra in (("fsdp", 0), ("prefetch_all", 0), ("ac", recomputed)):
        r = got[key]
        assert r["tracked_peak"] <= bound(units, 2, 2) + r["activations_peak"] + extra + 64 * 1024, key
        # at the end of forward every shard, the gathered root and every activation are alive at once (the
        # model states peak later, in backward, when some activations are gone)
        sharded = sum(u["padded_numel"] for u in units) // 2 * 16
        assert r["tracked_peak"] >= max(r["states_peak"], sharded + ROOT * 4 + r["activations_peak"]), key


@pytest.mark.timeout(150)
def test_memory_over_time_is_in_the_trace():
    """What the notebook plots: each unit's gather raises the parameter bytes by the unit, its free lowers them."""
    samples = results(2)["watched"]
    events = [e for e, _, _ in samples]
    for unit in ("(root)", "blocks.0", "blocks.1"):
        assert events.count(f"gathered {unit}") == 2 and f"reduce-scatter {unit}" in events
    gathered = events.index("gathered blocks.0")  # forward: right after the gather, then after the free
    freed = events.index("freed blocks.0")
    assert samples[gathered][1] - samples[freed][1] == BLOCK * 4


@pytest.mark.timeout(150)
def test_activation_checkpointing_saves_activations():
    got = results(2)
    assert got["ac"]["activations_peak"] < 0.6 * got["fsdp"]["activations_peak"]
    assert got["ac"]["activations_peak"] < got["ac_every_2"]["activations_peak"] < got["fsdp"]["activations_peak"]
    assert got["ac"]["tracked_peak"] < got["ac_op"]["tracked_peak"] < got["fsdp"]["tracked_peak"]  # its cache held
    assert got["ac"]["tracked_peak"] < got["fsdp"]["tracked_peak"]


# --- deferred initialization --------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_deferred_initialization():
    """Meta device -> units materialized one at a time: the values equal a normal build initialized by the
    same seeded function, training matches one process, and no rank ever held the whole model."""
    got = results(2)["deferred"]
    reference = initialize(tiny_gpt(**BIG), seeded_init(0))
    full = {n: p.detach() for n, p in reference.named_parameters()}
    assert max_diff(got["initial"], full) == 0
    losses, params = accumulated_oracle(2, tuple(BIG.items()))
    assert got["losses"] == losses and max_diff(got["params"], params) == 0  # to the bit
    model_bytes = sum(p.numel() for p in full.values()) * 4
    for rank in got["every_rank"]:
        assert rank["peak"] < 0.75 * model_bytes  # a rank allowed 3/4 of the model could build it


# --- checkpoints --------------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_checkpoints_round_trip():
    got = results(2)["checkpoints"]
    assert got["sharded"] == 0 and got["sharded_resumed"] == got["resumed"]
    for strategy in ("zero1", "zero2", "zero3", "ddp"):
        assert got[f"into_{strategy}"] == 0, strategy
    assert got["back_from_zero2"] == 0
    assert set(got["reference"]["optimizer"]["state"]["blocks.0.mlp.fc.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.timeout(150)
def test_checkpoint_into_local_and_another_world_size():
    reference = results(2)["checkpoints"]["reference"]
    assert ckpt_diff(reference, local_checkpoint()) == 0
    got = results(4)["checkpoints"]
    for key in ("w4", "w4_hsdp"):
        assert ckpt_diff(reference, got[key]) == 0
        resumed = results(2)["checkpoints"]["resumed"]
        assert max(abs(a - b) for a, b in zip(got[f"{key}_resumed"], resumed)) < ATOL


@pytest.mark.timeout(150)
def test_checkpoint_errors():
    found = results(2)["errors"]
    assert "shapes differ" in found["shapes"] and found["shapes_unchanged"]
    assert "another model" in found["another_model"] and found["another_model_unchanged"]
    assert "damaged" in found["corrupt"] and found["corrupt_unchanged"]
    assert "no checkpoint" in found["missing"] and found["missing_unchanged"]
    assert "AdamW" in found["optimizer_kind"]
    got = results(4)["checkpoints"]
    assert "world size it was saved from" in got["sharded_other_world"] and got["sharded_unchanged"]
    assert "sharding_group_size=4" in got["sharded_other_layout"] and "same layout" in got["sharded_other_layout"]


def test_checkpoint_errors_in_one_process(tmp_path):
    model, opt = wrap(build(), "local", optimizer=OPT)
    path = tmp_path / "x.pt"
    ckpt.save_full(model, opt, str(path))
    bad, bad_opt = wrap(build(d_model=28), "local", optimizer=OPT)
    before = {k: v.clone() for k, v in bad.full_state_dict().items()}
    with pytest.raises(ValueError, match="shapes differ"):
        ckpt.load_full(bad, bad_opt, str(path))
    assert max_diff(before, bad.full_state_dict()) == 0
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="damaged"):
        ckpt.load_full(model, opt, str(path))
    torch.save({"format": "something else"}, path)
    with pytest.raises(ValueError, match="not a full toolkit checkpoint"):
        ckpt.load_full(model, opt, str(path))


# --- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_errors_on_ranks():
    found = results(2)["errors"]
    assert "sharding_group_size=3" in found["group_size"] and "[1, 2]" in found["group_size"]
    assert "sharding_group_size=3" in results(4)["checkpoints"]["group_size"]
    assert "param_init_fn" in found["meta_without_init"]
    assert "no_sync" in found["no_sync_only"]
    total = sum(p.numel() for p in build().parameters())
    for strategy in ("fsdp", "zero3"):  # between steps: p.sum() read freed memory (a SIGSEGV), state_dict() too
        assert found[f"{strategy} pieces add up"]
        assert total / 2 <= found[f"{strategy} pieces"] < total / 2 + 100  # half of every unit, less its padding
        for key, name in ((f"{strategy} state_dict", "'module.tok_emb.weight'"), (f"{strategy} block state_dict", "")):
            assert found[key].startswith("RuntimeError: state_dict(): " + name), found[key]
            assert "only this rank's piece of it between steps" in found[key] and "full_state_dict(model)" in found[key]
        assert found[f"{strategy} full_state_dict"]


def test_bad_options_and_policies():
    with pytest.raises(ValueError, match="valid options"):
        wrap(build(), "fsdp", optimizer=OPT, bucket_cap_mb=1)
    with pytest.raises(ValueError, match="elementwise"):
        wrap(build(), "fsdp", optimizer=torch.optim.LBFGS)
    with pytest.raises(ValueError, match="mixed_precision"):
        wrap(build(), "fsdp", optimizer=OPT, mixed_precision="fp8")
    with pytest.raises(ValueError, match="unknown keys"):
        wrap(build(), "fsdp", optimizer=OPT, mixed_precision={"param": "bf16"})
    with pytest.raises(ValueError, match="MixedPrecision dtype"):
        wrap(build(), "fsdp", optimizer=OPT, mixed_precision=MixedPrecision(torch.int8))
    with pytest.raises(ValueError, match="True or False"):
        wrap(build(), "fsdp", optimizer=OPT, forward_prefetch="yes")
    with pytest.raises(ValueError, match="matched no module"):
        wrap(build(), "fsdp", optimizer=OPT, wrap_policy=nn.Conv2d)
    with pytest.raises(ValueError, match="matched no module"):
        wrap(build(), "fsdp", optimizer=OPT, wrap_policy=10**9)
    with pytest.raises(ValueError, match="not a submodule"):
        wrap(build(), "fsdp", optimizer=OPT, wrap_policy=["blocks.7"])
    with pytest.raises(ValueError, match="container"):
        wrap(build(), "fsdp", optimizer=OPT, wrap_policy=["blocks"])
    with pytest.raises(ValueError, match="not a policy"):
        wrap(build(), "fsdp", optimizer=OPT, wrap_policy="blocks")
    with pytest.raises(ValueError, match="unit_class"):
        wrap(build(), "fsdp", optimizer=OPT, unit_class=nn.Linear)
    with pytest.raises(RuntimeError, match="toolkit.launch"):
        wrap(build(), "fsdp", optimizer=OPT)


def test_the_absent_rate_limiter_is_named_not_silently_ignored():
    """torch FSDP's `limit_all_gathers=True` is not implemented: asking for it says why and what to do."""
    with pytest.raises(ValueError, match=r"limit_all_gathers=True.*rate limiter.*GPUs.*differences\.md"):
        wrap(build(), "fsdp", optimizer=OPT, limit_all_gathers=True)
    with pytest.raises(RuntimeError, match="toolkit.launch"):  # False is what this FSDP does: accepted
        wrap(build(), "fsdp", optimizer=OPT, limit_all_gathers=False)
    assert "limit_all_gathers" in toolkit.parallel.fsdp.__doc__
