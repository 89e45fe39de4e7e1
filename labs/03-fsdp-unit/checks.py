"""The graded checks of lab 03 (one FSDP unit), judged in the grader's process.

Each rank plugs your `MyUnit` into the toolkit's FSDP (`student.wrap`, i.e. `unit_class=MyUnit`) on the
toolkit's tiny GPT, built from a seed drawn for this grading: 3 units (the root with the tied embedding,
and one per block). Here the same model trains alone on the whole batch: the reference a correct FSDP must
match. At 3 ranks the flat parameters are padded (a block's 12,704 elements are not a multiple of 3), so
a unit that forgets the padding shows there.
"""

import types

import torch

from toolkit.grading import Fields, Items, Maybe, Tensor, check, like, model_labs
from toolkit.models import tiny_gpt
from toolkit.parallel.flat import FlatBuffer

ANSWERS = {
    "toolkit.parallel.fsdp_unit:FSDPUnit.unshard": "the toolkit's own unshard",
    "toolkit.parallel.fsdp_unit:FSDPUnit.wait_unshard": "the toolkit's own wait_unshard",
    "toolkit.parallel.fsdp_unit:FSDPUnit.reshard": "the toolkit's own reshard",
    "toolkit.parallel.fsdp_unit:FSDPUnit.reduce_grad": "the toolkit's own reduce_grad",
    "toolkit.parallel.zero3:Zero3._gather": "ZeRO-3's gather, unshard under another name",
    "toolkit.parallel.zero3:Zero3._reduce_scatter": "ZeRO-3's gradient reduce-scatter, reduce_grad's",
}
BUILDS_ON = [
    "toolkit.parallel.fsdp_unit:FSDPUnit.add_grad",
    "toolkit.parallel.fsdp_unit:FSDPUnit.finish_reduce",
    "toolkit.parallel.fsdp_unit:sharding_groups",
]  # FSDP's groups (lab 07's), hybrid or not
GLOBAL_BATCH = 12  # rows per step over all ranks: splits evenly over 2 and 3 ranks
STEPS, LR = 3, 0.1
# SGD with momentum, not Adam: Adam divides each gradient by its own running size, so it would hide a
# gradient N times too large (summed, not averaged), and it turns rounding noise in gradients that are
# zero in exact arithmetic into full-size steps. SGD keeps both visible and small, respectively.
OPTIMIZER = dict(lr=LR, momentum=0.9)


def training(steps):
    return model_labs.training(steps, GLOBAL_BATCH, OPTIMIZER)


def local(seed, steps):
    """The reference: one process, the whole batch; after `steps` SGD steps (0: one backward)."""
    return model_labs.local(seed, steps, GLOBAL_BATCH, torch.optim.SGD, OPTIMIZER)


PARAMETERS = model_labs.parameters()  # the tiny GPT's: names, shapes, dtypes


def units(n) -> list[dict]:
    """FSDP's units of the tiny GPT at world size n, as the grader works them out: name, parameters, padding."""
    return model_labs.fsdp_units(n)


def per_unit(n, spec) -> dict:
    """A spec for one entry per unit, under the unit's name; `spec` is a spec, or a function of the unit."""
    return {unit["name"]: spec(unit) if isinstance(spec, types.FunctionType) else spec for unit in units(n)}


def values_of(unit) -> dict:
    return {name: like(PARAMETERS[name]) for name in unit["param_names"]}


def expect_values(ctx, values, reference, what, unit, r):
    """Every parameter of the unit (a view into the flat parameter) equals the reference's."""
    for name, p in values.items():
        ctx.expect(p, reference[name].detach(), f"{what}: parameter {name!r} of unit {unit!r}", rank=r)


COMM = Fields({"name": str, "args": Fields({"group": [int], "numel": int, "bytes_sent": int}, extra=True)}, extra=True)


# --- the checks ----------------------------------------------------------------------------------------
def gathered(case, r, n):
    return {
        "units": per_unit(
            n, lambda u: {"state": str, "held": int, "gathers": [bool], "carried": [COMM], "values": values_of(u)}
        ),
        "async": {
            "gathers": [bool],
            "carried": [COMM],
            "state_before_wait": str,
            "state": str,
            "values": values_of(units(n)[-1]),
        },
    }


@check(
    "unshard: the all-gather fills the full flat parameter (blocking, and asynchronous until wait_unshard)",
    points=2,
    world_sizes=(2, 3),
    inputs=training(0),
    returns=gathered,
)
def unshard_gathers(ctx, given, got):
    torch.manual_seed(given[0]["seed"])
    reference = dict(tiny_gpt().named_parameters())
    for r in range(ctx.world_size):
        for unit in units(ctx.world_size):
            name, mine, full = unit["name"], got[r]["units"][unit["name"]], unit["padded"] * 4
            if mine["state"] != "gathered":
                ctx.fail(
                    f"rank {r}: after unshard(), unit {name!r} is in state {mine['state']!r}, expected "
                    "'gathered' (set self.state = GATHERED once the all-gather is done)"
                )
            if mine["held"] != full:
                ctx.fail(
                    f"rank {r}: after unshard(), the flat parameter of unit {name!r} holds {mine['held']} bytes, "
                    f"expected {full} ({unit['padded']} elements of 4 bytes): resize its storage back before "
                    "gathering into it"
                )
            ctx.over_everyone(mine["carried"], f"unshard() of unit {name!r}", r)
            carried = [e["name"] for e in mine["carried"]]  # what the grader's relay carried, not the rank's trace
            if carried != ["all_gather"] or len(mine["gathers"]) != 1:
                ctx.fail(
                    f"rank {r}: unshard() of unit {name!r} made the grader's relay carry {carried or 'nothing'} "
                    f"and issued {len(mine['gathers'])} all-gathers through toolkit.comm, expected exactly 1 "
                    "all-gather (comm.all_gather of the master slice into the flat parameter)"
                )
            expect_values(ctx, mine["values"], reference, "after unshard()", name, r)
        later = got[r]["async"]
        ctx.over_everyone(later["carried"], "unshard(async_op=True)", r)
        if not later["gathers"] or not later["gathers"][0] or [e["name"] for e in later["carried"]] != ["all_gather"]:
            ctx.fail(
                f"rank {r}: unshard(async_op=True) must issue its all-gather with async_op=True and return at "
                "once (the handle lets wait_unshard finish it later): that is what prefetching is"
            )
        if later["state_before_wait"] != "gathering":
            ctx.fail(
                f"rank {r}: right after unshard(async_op=True) the unit is {later['state_before_wait']!r}, "
                "expected 'gathering' until wait_unshard() has waited for the handle"
            )
        if later["state"] != "gathered":
            ctx.fail(f"rank {r}: after wait_unshard() the unit is {later['state']!r}, expected 'gathered'")
        expect_values(
            ctx,
            later["values"],
            reference,
            "after unshard(async_op=True) and wait_unshard()",
            units(ctx.world_size)[-1]["name"],
            r,
        )


def freed(case, r, n):
    return {
        "after_reshard": per_unit(n, {"held": int, "state": str}),
        "in_flight": {"waits": int, "held": int, "state": str},
        "after_forward": per_unit(n, int),
        "while_running": per_unit(n, Items(Maybe(str), int)),
        "after_backward": per_unit(n, int),
    }


@check(
    "reshard frees: 0 bytes after reshard, after forward and after backward; gathered while its module runs",
    points=2,
    world_sizes=(2,),
    inputs=training(1),
    returns=freed,
)
def memory_is_freed(ctx, given, got):
    for r in range(ctx.world_size):
        mine = got[r]
        for unit in units(ctx.world_size):
            name, after = unit["name"], mine["after_reshard"][unit["name"]]
            if after["held"] != 0:
                ctx.fail(
                    f"rank {r}: after reshard(), unit {name!r}'s flat parameter still holds {after['held']} "
                    "bytes: free it with self.flat.data.untyped_storage().resize_(0) (the tensor and its views "
                    "stay valid, only the memory goes)"
                )
            if after["state"] != "sharded":
                ctx.fail(f"rank {r}: after reshard(), unit {name!r} is in state {after['state']!r}, expected 'sharded'")
        flight = mine["in_flight"]
        if flight["waits"] < 1:
            ctx.fail(
                f"rank {r}: reshard() of a unit whose all-gather was still in flight (unshard(async_op=True) just "
                "before) freed its memory without waiting for the all-gather, which would go on writing into "
                "freed memory: when the unit is GATHERING, wait for it first (wait_unshard)"
            )
        if flight["held"] != 0 or flight["state"] != "sharded":
            ctx.fail(
                f"rank {r}: reshard() of a unit whose all-gather was in flight left it {flight['state']!r} with "
                f"{flight['held']} bytes; expected 'sharded' and 0 bytes"
            )
        for unit in units(ctx.world_size):
            name, full = unit["name"], unit["padded"] * 4
            state, held = mine["while_running"][name]
            if state != "gathered":
                ctx.fail(
                    f"rank {r}: unit {name!r}'s module ran while the unit was {state!r}, not 'gathered': "
                    "a prefetched unit's all-gather is still in flight when FSDP calls unshard() for it, and "
                    "unshard() (without async_op) must then wait for it (wait_unshard) before returning"
                )
            if held != full:
                ctx.fail(
                    f"rank {r}: while unit {name!r}'s module ran, its flat parameter held {held} bytes, expected {full}"
                )
        for when in ("forward", "backward"):
            kept = {name: held for name, held in mine[f"after_{when}"].items() if held}
            if kept:
                ctx.fail(
                    f"rank {r}: after {when}, the gathered parameters of units {kept} (bytes) were not freed"
                    + (
                        ": FSDP calls reshard() right after each unit's forward, and reshard must resize the "
                        "storage to 0"
                        if when == "forward"
                        else ""
                    )
                )


@check(
    "per step, every unit: 2 all-gathers (forward, backward) and 1 reduce-scatter, nothing else",
    points=2,
    world_sizes=(2, 3),
    task="one_step",
    inputs=training(1),
    returns={"comms": [COMM]},
)
def collectives_per_unit(ctx, given, got):
    padded = sorted(unit["padded"] for unit in units(ctx.world_size))
    for r in range(ctx.world_size):
        events = got[r]["comms"]
        if not events:
            ctx.fail(
                f"rank {r}: the grader's relay carried no collective in a training step (gather with "
                "comm.all_gather and reduce with comm.reduce_scatter)"
            )
        ctx.over_everyone(events, "a training step", r)
        names = sorted({e["name"] for e in events} - {"all_gather", "reduce_scatter"})
        if names:
            ctx.fail(f"rank {r}: a step issued {names} besides all-gathers and reduce-scatters")
        for op, per_unit_count in (("all_gather", 2), ("reduce_scatter", 1)):
            sizes = sorted(e["args"]["numel"] for e in events if e["name"] == op)
            if sizes != sorted(padded * per_unit_count):
                ctx.fail(
                    f"rank {r}: the {op}s of one step moved flat tensors of {sizes} elements; with "
                    f"{len(padded)} units of {padded} padded elements, expected each unit {per_unit_count} "
                    f"time(s): {sorted(padded * per_unit_count)}"
                )


@check(
    "bytes on the wire: 3Ψ(N-1)/N per rank per step (Ψ the padded elements, 4 bytes each)",
    points=1,
    world_sizes=(2, 3),
    task="one_step",
    inputs=training(1),
    returns={"comms": [COMM]},
)
def bytes_per_step(ctx, given, got):
    n = ctx.world_size
    psi = sum(unit["padded"] for unit in units(n))
    for r in range(n):
        events = got[r]["comms"]
        sent = sum(e["args"]["bytes_sent"] for e in events)
        theory = 3 * psi * 4 * (n - 1) / n
        if abs(sent - theory) > len(events):  # the door rounds each call down to whole bytes
            ctx.fail(
                f"rank {r}: a step sent {sent} bytes; 3Ψ(N-1)/N with Ψ = {psi} padded elements of 4 bytes "
                f"and N = {n} is {theory:.0f}"
            )


@check(
    "after one backward each rank holds its slice of the whole batch's gradient (the average over ranks)",
    points=2,
    world_sizes=(2, 3),
    inputs=training(1),
    returns=lambda case, r, n: {"grads": per_unit(n, lambda u: Maybe(Tensor((u["shard"],), torch.float32)))},
)
def averaged_gradient_slices(ctx, given, got):
    grads = {name: p.grad for name, p in local(given[0]["seed"], 0).named_parameters()}
    for r in range(ctx.world_size):
        for unit in units(ctx.world_size):
            expected_flat = FlatBuffer(unit["shapes"], ctx.world_size)
            expected_flat.copy_from([grads[name] for name in unit["param_names"]])
            expected = expected_flat.shard(r)
            got_grad = got[r]["grads"][unit["name"]]
            if got_grad is None:
                ctx.fail(
                    f"rank {r}: unit {unit['name']!r} has no gradient slice after backward: did reduce_grad "
                    "leave (handle, output, input) in self.reduction?"
                )
            hint = ""
            if not torch.allclose(got_grad, expected, rtol=1e-4, atol=1e-6):
                ratio = (got_grad.double().norm() / expected.double().norm().clamp_min(1e-30)).item()
                if abs(ratio - ctx.world_size) < 0.05 * ctx.world_size:
                    hint = (
                        f" It is about {ctx.world_size}x too large: the ranks' gradients were summed, not "
                        "averaged (reduce-scatter with op='avg')."
                    )
            ctx.expect(
                got_grad,
                expected,
                f"gradient slice of unit {unit['name']!r}{hint}",
                rank=r,
                exact=False,
                rtol=1e-4,
                atol=1e-6,
            )


@check(
    "parity with 'local': 3 SGD steps (with forward and backward prefetch) give one process's parameters",
    points=2,
    world_sizes=(2, 3),
    inputs=training(STEPS),
    returns={"params": {name: like(p) for name, p in PARAMETERS.items()}},
)
def parity_with_local(ctx, given, got):
    reference = local(given[0]["seed"], STEPS)
    for r in range(ctx.world_size):
        for name, p in reference.named_parameters():
            ctx.expect(
                got[r]["params"][name],
                p.detach(),
                f"{name!r} after {STEPS} SGD steps (lr={LR}, momentum 0.9)",
                rank=r,
                exact=False,
                rtol=1e-4,
                atol=1e-5,
            )
