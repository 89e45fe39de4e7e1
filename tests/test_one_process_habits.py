"""Code written for one process, run on a wrapped model: it gets the training it asked for, or an error that says
what to call. Never a silently wrong number.

- `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` reads `p.grad`, which after a sharded backward is not
  the gradient (`toolkit/parallel/grad_in_slices.py`): before, it clipped nothing and returned 0 (ZeRO-2/3, FSDP)
  or a norm that differed from rank to rank (ZeRO-1: 1.19 and 0.97 for a true 0.88). Now it raises, naming
  `model.clip_grad_norm_`, which gives the one-process norm. So does a torch optimizer built on
  `model.parameters()` (it stepped nothing, or each rank its own way), naming the optimizer `wrap()` returned.
- `model.zero_grad()` (nn.Module's, where the loop clears the model rather than the optimizer) clears the
  gradients the strategy keeps in its slices. Before, ZeRO-2/3 and FSDP added every step's gradient into the next
  (the losses left one process's from the third step on), and ZeRO-1 refused the next backward.
- `model.module.load_state_dict(weights)` loads where the strategy trains them (`toolkit/parallel/loading.py`): under
  mixed precision into the fp32 masters too (before, the next step rounded the old masters back over the loaded
  weights: 1.04 away from them after one step at lr 0), and under ZeRO-3 and FSDP into this rank's slices, where the
  parameters are its pieces (torch's own "size mismatch" before). `assign=True` is refused everywhere.
- `model.to(torch.float64)` (or `.half()`, `.cuda()`) after `wrap()` refuses where it would change a parameter's dtype
  or device, naming `mixed_precision=True` and casting before `wrap()`. Before, ZeRO-2 trained detached copies that the
  optimizer never updated (its losses rose), ZeRO-3 and FSDP dropped the cast at the next use, DDP and ZeRO-1 failed
  in backward on a gradient's dtype. A cast the wrapper never sees (`model.module.double()`, `p.data = ...`) is
  refused at the next forward: before, DDP, ZeRO-1 and (except after `model.module.double()`) ZeRO-2 failed inside
  with torch's "mixed dtype", and ZeRO-3 and FSDP trained on.
- A parameter frozen (`requires_grad_(False)`) after `wrap()` is refused at the end of the backward, naming it:
  the strategy laid it out to train, gave it a zero gradient, and AdamW's weight decay still moved it (one process's
  optimizer skips it: it stays put, as under "local").
- A sharded optimizer's `state_dict()` is this rank's slices' states: each rank resumes from its own and trains as
  the run that never stopped, and another rank's (the same shapes) is refused, naming `save_full`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from oracle import plain_training
from test_zero import CLIP, OPT, STEPS, batches, build, max_diff

import toolkit
from toolkit.models import tiny_gpt
from toolkit.parallel import wrap
from toolkit.parallel.grad_in_slices import is_placeholder

STRATEGIES = ["zero1", "zero2", "zero3", "fsdp"]


def run_rank(n: int) -> dict:
    """Every habit of the module docstring on every strategy it concerns, in one launch; errors are recorded, so a
    broken mechanism fails its own tests rather than the whole launch."""
    rank, out = torch.distributed.get_rank(), {}
    for strategy in STRATEGIES:
        model, opt = wrap(build(), strategy, optimizer=OPT)
        losses, error = [], None
        try:
            for x, y in batches(rank, n):
                loss = model(x, y)
                loss.backward()
                opt.step()
                model.zero_grad()  # nn.Module's habit: the model, not the optimizer
                losses.append(loss.item())
        except RuntimeError as exc:
            error = str(exc)
        out[strategy] = {"losses": losses, "error": error, "params": model.full_state_dict()}

        model, _ = wrap(build(), strategy, optimizer=OPT)
        x, y = batches(rank, n)[0]
        model(x, y).backward()
        params = list(model.parameters())
        out[f"{strategy} after backward"] = {
            "refusal": refusal(functools.partial(torch.nn.utils.clip_grad_norm_, params, CLIP)),
            "own optimizer": refusal(torch.optim.AdamW(model.parameters(), lr=1e-3).step),
            "placeholders": sum(is_placeholder(p.grad) for p in params),
            "params": len(params),
            "shapes kept": all(
                p.grad is not None and (p.grad.shape, p.grad.dtype) == (p.shape, p.dtype) for p in params
            ),
            "repr": repr(params[0].grad),
            "grads counted": sum(is_placeholder(t) for t in model.memory_groups()["grads"]),
            "norm": model.clip_grad_norm_(CLIP).item(),
        }
        model.zero_grad()
        out[f"{strategy} after backward"]["cleared"] = all(p.grad is None or not is_placeholder(p.grad) for p in params)
    for strategy in ["local", "ddp", *STRATEGIES]:
        for mixed in (False, True):
            out[("load", strategy, mixed)] = load_then_step(rank, n, strategy, mixed)
    for strategy in ("zero3", "fsdp"):  # a value of the wrong shape for a parameter that is this rank's piece
        model, _ = wrap(build(), strategy, optimizer=OPT)
        wrong = {**build().state_dict(), "tok_emb.weight": torch.zeros(3, 3)}
        out[("wrong shape", strategy)] = refusal(functools.partial(model.module.load_state_dict, wrong))
    for strategy in STRATEGIES:
        out[("resume", strategy)] = resume(rank, n, strategy)
    for strategy in ["local", "ddp", *STRATEGIES]:
        model, _ = wrap(build(), strategy, optimizer=OPT)
        model.to(torch.float32).float()  # changes nothing: allowed
        out[("cast", strategy)] = refusal(functools.partial(model.to, torch.float64))
        for how in ("model.module", "p.data"):
            out[("cast inside", strategy, how)] = cast_inside_then_forward(rank, n, strategy, how)
        out[("freeze", strategy)] = freeze_after_wrap(rank, n, strategy)
    for strategy in ("zero3", "fsdp"):  # gathered in bf16 is the strategy's own dtype; fp16 is a cast
        out[("cast inside, mixed", strategy)] = cast_inside_then_forward(
            rank, n, strategy, "half", mixed_precision=True
        )
    return out


def cast_inside_then_forward(rank: int, n: int, strategy: str, how: str, **options):
    """The model cast where the wrapper's own `.to()` never sees it, then a forward: the refusal, or None."""
    model, _ = wrap(build(), strategy, optimizer=OPT, **options)
    if how == "model.module":
        model.module.double()
    elif how == "half":
        model.module.half()
    else:
        weight = model.module.tok_emb.weight
        weight.data = weight.data.double()
    x, y = batches(rank, n)[0]
    return refusal(lambda: model(x, y))


def freeze_after_wrap(rank: int, n: int, strategy: str):
    """The embedding (tied to the head) frozen after wrap(), then a step: how far it moved, or the refusal."""
    model, opt = wrap(build(), strategy, optimizer=OPT)
    model.module.tok_emb.weight.requires_grad_(False)
    before = model.full_state_dict()["tok_emb.weight"]
    x, y = batches(rank, n)[0]
    stopped = refusal(lambda: model(x, y).backward())
    if stopped is not None:
        return stopped
    opt.step()
    return (model.full_state_dict()["tok_emb.weight"] - before).abs().max().item()


def resume(rank: int, n: int, strategy: str) -> dict:
    """Half the steps, each rank saving its optimizer's state_dict(); a new model from the weights, the state
    loaded, the other half: the parameters of the run that never stopped. And another rank's state refused."""
    data, half = batches(rank, n), STEPS // 2

    def train(model, opt, steps):
        for x, y in steps:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()

    model, opt = wrap(build(), strategy, optimizer=OPT)
    train(model, opt, data)
    whole = model.full_state_dict()
    model, opt = wrap(build(), strategy, optimizer=OPT)
    train(model, opt, data[:half])
    weights, saved = model.full_state_dict(), opt.state_dict()
    theirs = [None] * n
    torch.distributed.all_gather_object(theirs, saved)
    restarted = build()
    restarted.load_state_dict(weights, strict=False)  # before wrap(): the advised way in (the head is tied)
    model, opt = wrap(restarted, strategy, optimizer=OPT)
    other = refusal(lambda: opt.load_state_dict(theirs[(rank + 1) % n]), ValueError)
    opt.load_state_dict(saved)
    train(model, opt, data[half:])
    return {"distance": max_diff(model.full_state_dict(), whole), "other rank's": other}


def load_then_step(rank: int, n: int, strategy: str, mixed: bool):
    """Other weights loaded into the wrapped model's module after a step, then a step at lr 0: the largest distance
    from the loaded weights (0: they are what trains), or the refusal."""
    model, opt = wrap(build(), strategy, optimizer=functools.partial(torch.optim.SGD, lr=0.0), mixed_precision=mixed)
    x, y = batches(rank, n)[0]
    for step in range(2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            weights = build()
            with torch.no_grad():
                for p in weights.parameters():
                    p.normal_(0, 0.02)
            weights = weights.state_dict()
            fresh = build().state_dict()  # (torch marks a dict's metadata with assign=True for good: another dict)
            assigned = refusal(functools.partial(model.module.load_state_dict, fresh, assign=True))
            loading = refusal(functools.partial(model.module.load_state_dict, weights))
            if loading is not None:
                return {"refused": loading, "assign": assigned}
    distance = max((v.float() - weights[k]).abs().max().item() for k, v in model.full_state_dict().items())
    return {"distance": distance, "assign": assigned}


def refusal(call, kind=RuntimeError) -> str | None:
    try:
        call()
    except kind as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def ranks():
    return toolkit.launch(run_rank, 2, args=(2,), timeout_s=150, quiet=True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_clip_on_a_sharded_model_refuses_and_names_the_call_that_works(ranks, strategy):
    _, norms, _ = plain_training(build(), batches()[:1], OPT, clip=CLIP)
    for got in ranks:
        seen = got[f"{strategy} after backward"]
        assert seen["refusal"] is not None, "torch's clip_grad_norm_ ran on p.grad that is not the gradient"
        assert "model.clip_grad_norm_(max_norm)" in seen["refusal"] and strategy in seen["refusal"]
        assert "optimizer wrap() returned" in seen["own optimizer"]  # it stepped nothing, or each rank its own way
        assert seen["placeholders"] == seen["params"] and seen["shapes kept"]
        assert "slices" in seen["repr"]
        assert seen["grads counted"] == 0  # a placeholder has no bytes: the memory ledger does not see it
        assert abs(seen["norm"] - norms[0]) < 1e-5  # the call it names gives the one-process norm
        assert seen["cleared"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_zero_grad_clears_the_slices_as_the_optimizers_does(ranks, strategy):
    losses, _, params = plain_training(build(), batches(), OPT)
    assert all(got[strategy]["error"] is None for got in ranks), ranks[0][strategy]["error"]
    mean = [sum(step) / len(step) for step in zip(*(got[strategy]["losses"] for got in ranks))]  # the batch's loss
    assert len(mean) == STEPS and max(abs(a - b) for a, b in zip(mean, losses)) < 1e-5
    for got in ranks:
        assert max_diff(got[strategy]["params"], params) < 1e-5


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["local", "ddp", *STRATEGIES])
def test_loading_weights_into_a_wrapped_model_trains_them(ranks, strategy):
    for got in ranks:
        for mixed in (False, True):
            seen = got[("load", strategy, mixed)]
            assert "assign=True would replace the Parameter objects" in seen["assign"]
            assert "load_full(model, optimizer, path)" in seen["assign"] and "tok_emb.weight" in seen["assign"]
            # exactly the loaded fp32 values train: the masters took them (mixed precision), and ZeRO-3's and
            # FSDP's slices of them where the parameters are this rank's pieces
            assert seen.get("distance") == 0.0, (mixed, seen)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_rank_resumes_from_its_own_optimizer_state_dict_and_refuses_anothers(ranks, strategy):
    for got in ranks:
        seen = got[("resume", strategy)]
        assert seen["distance"] < 1e-6  # Adam's moments came back: before, the loaded state never reached the step
        assert seen["other rank's"] is not None and "save_full(model, optimizer, path)" in seen["other rank's"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["local", "ddp", *STRATEGIES])
def test_casting_a_wrapped_model_refuses_and_names_mixed_precision(ranks, strategy):
    for got in ranks:
        seen = got[("cast", strategy)]
        assert seen is not None and "'tok_emb.weight' torch.float64" in seen, seen
        assert "before wrap(model, ...)" in seen and "mixed_precision=True" in seen
        for how in ("model.module", "p.data"):  # where the wrapper's .to() never sees it: at the next forward
            seen = got[("cast inside", strategy, how)]
            assert seen is not None and "'tok_emb.weight' torch.float64" in seen, (how, seen)
            assert "since wrap()" in seen and "mixed_precision=True" in seen


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_sharded_model_gathered_in_its_compute_dtype_is_not_a_cast(ranks, strategy):
    """Under mixed precision FSDP and ZeRO-3 keep fp32 shards and gather bf16 parameters to compute. A pipeline stage
    keeps its units gathered between micro-batches (`reshard_after_forward=False`, as Llama 3's layout runs), so its
    next forward meets bf16 parameters: the strategy's own dtype, not a cast (the refusal had stopped that layout's
    simulation, `make test-papers`). A cast to fp16 inside is still refused."""
    from toolkit.sim import simulate

    if strategy == "fsdp":
        sim = simulate(
            lambda: tiny_gpt(n_layer=4, d_model=64, n_head=4),
            "fsdp",
            4,
            pp=2,
            microbatches=2,
            batch_per_rank=2,
            mixed_precision=True,
            reshard_after_forward=False,
            progress=False,
        )
        assert sim.num_params > 0
    for got in ranks:
        seen = got[("cast inside, mixed", strategy)]
        assert seen is not None and "'tok_emb.weight' torch.float16" in seen, seen


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["local", "ddp", *STRATEGIES])
def test_freezing_after_wrap_refuses_where_the_frozen_parameter_would_still_move(ranks, strategy):
    for got in ranks:
        seen = got[("freeze", strategy)]
        if strategy == "local":  # torch's optimizer skips a parameter without a gradient
            assert seen == 0.0
        else:
            assert isinstance(seen, str) and "'tok_emb.weight' stopped requiring gradients after wrap()" in seen
            assert "before wrap(model, ...)" in seen


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_loading_a_wrong_shape_into_a_piece_says_size_mismatch(ranks, strategy):
    for got in ranks:
        seen = got[("wrong shape", strategy)]
        assert seen is not None and "size mismatch for 'tok_emb.weight'" in seen and "(3, 3)" in seen, seen
