"""The graded checks of lab 11 (tensor parallelism), judged in the grader's process. Every check runs on 2 ranks.

Every rank builds the same whole MLP (d 16 -> 64 -> GELU -> 16, the toolkit GPT's `MLP`, biases not zero) from
a seed drawn for this grading and gets the same input; your split layers must reproduce what the whole layers
compute on one process (computed here), in forward and backward, talking only where Megatron's f and g talk.
"""

import torch
import torch.nn.functional as F

from toolkit.grading import Fields, List, Maybe, Tensor, check, like
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.models.gpt import MLP, GPTConfig

ANSWERS = {
    "toolkit.parallel.tensor": "the toolkit's own tensor parallelism",
    "torch.distributed.tensor.parallel": "PyTorch's tensor parallelism",
}
D, B, T = 16, 2, 8
TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # fp32: the split sums add t partial sums in another order


def whole_mlp(seed) -> MLP:
    torch.manual_seed(seed)
    return MLP(GPTConfig(d_model=D))


def mlp_and_input(n, g):
    return {"seed": int(torch.randint(0, 2**31, (), generator=g)), "x": torch.randn(B, T, D, generator=g)}


def piece(t: torch.Tensor, r: int, n: int, dim: int) -> torch.Tensor:
    return t.chunk(n, dim=dim)[r]


F32 = torch.float32
COMM = Fields({"name": str, "args": Fields({"group": [int], "numel": int}, extra=True)}, extra=True)


def operator(case, r, n):
    return {"y": like(case["x"]), "grad": Maybe(like(case["x"]))}


def split_mlp(case, r, n):
    h = 4 * D // n  # this rank's share of the hidden features
    return {
        "out": like(case["x"]),
        "x_grad": Maybe(like(case["x"])),
        "grads": {
            "fc.weight": Maybe(Tensor((h, D), F32)),
            "fc.bias": Maybe(Tensor((h,), F32)),
            "proj.weight": Maybe(Tensor((D, h), F32)),
            "proj.bias": Maybe(Tensor((D,), F32)),
        },
    }


@check(
    "f: identity forward, the gradients of every rank summed in backward",
    points=1,
    world_sizes=(2,),
    inputs=mlp_and_input,
    returns=operator,
)
def f_operator(ctx, given, got):
    x, n = given[0]["x"], ctx.world_size
    for r in range(n):
        ctx.expect(got[r]["y"], x, "f(x) in forward", rank=r)
        grad = got[r]["grad"]
        if isinstance(grad, torch.Tensor) and torch.allclose(grad, torch.full_like(x, r + 1.0)):
            ctx.fail(
                f"rank {r}: f's backward returned this rank's gradient only; every rank used x, so its gradient "
                "is the sum of theirs: all-reduce it"
            )
        ctx.expect(grad, torch.full_like(x, sum(k + 1 for k in range(n))), "the gradient of x through f", rank=r)


@check(
    "g: every rank's partial result summed in forward, identity in backward",
    points=1,
    world_sizes=(2,),
    inputs=mlp_and_input,
    returns=lambda case, r, n: dict(operator(case, r, n), input_after=like(case["x"])),
)
def g_operator(ctx, given, got):
    x, n = given[0]["x"], ctx.world_size
    for r in range(n):
        ctx.expect(got[r]["y"], x * sum(k + 1 for k in range(n)), "g(x) in forward", rank=r, exact=False, **TOLERANCE)
        if not torch.equal(got[r]["input_after"], x * (r + 1)):
            ctx.fail(f"rank {r}: g changed its input in place; all-reduce a copy (autograd may need the input)")
        grad = got[r]["grad"]
        if isinstance(grad, torch.Tensor) and torch.allclose(grad, torch.full_like(x, 3.0 * n)):
            ctx.fail(
                f"rank {r}: g's backward all-reduced the gradient too; the output's gradient is already the "
                "same on every rank, so g passes it through unchanged"
            )
        ctx.expect(grad, torch.full_like(x, 3.0), "the gradient of x through g", rank=r)


@check(
    "column-parallel forward: this rank's output features, no talk",
    points=1,
    world_sizes=(2,),
    inputs=mlp_and_input,
    returns=lambda case, r, n: {"y": Tensor((B, T, 4 * D // n), F32), "talked": [COMM]},
)
def column(ctx, given, got):
    mlp, x = whole_mlp(given[0]["seed"]), given[0]["x"]
    for r in range(ctx.world_size):
        talked = [e["name"] for e in got[r]["talked"]]
        if talked:
            ctx.fail(
                f"rank {r}: the column-parallel forward issued {talked}: a column-parallel layer needs "
                "no talk in forward (each rank computes its own output features from the whole input); an "
                "all-reduce there adds up features that belong to different columns. Its collective is f's, "
                "in backward"
            )
        ctx.expect(
            got[r]["y"],
            piece(mlp.fc(x).detach(), r, ctx.world_size, -1),
            "this rank's output features",
            rank=r,
            exact=False,
            **TOLERANCE,
        )


@check(
    "row-parallel forward: the whole output, the bias added once",
    points=1,
    world_sizes=(2,),
    inputs=mlp_and_input,
    returns=lambda case, r, n: {"y": like(case["x"])},
)
def row(ctx, given, got):
    mlp, x, n = whole_mlp(given[0]["seed"]), given[0]["x"], ctx.world_size
    expected = mlp.proj(F.gelu(mlp.fc(x))).detach()
    extra = (n - 1) * mlp.proj.bias.detach()
    for r in range(n):
        y = got[r]["y"]
        if torch.allclose(y, expected + extra, **TOLERANCE):
            ctx.fail(
                f"rank {r}: the output holds the bias {n} times: every rank added it before the all-reduce "
                "summed their partial results. Add the bias once, after g"
            )
        ctx.expect(y, expected, "the row-parallel layer's output", rank=r, exact=False, **TOLERANCE)


@check(
    "the split MLP: its output and every gradient equal the whole MLP's",
    points=2,
    world_sizes=(2,),
    inputs=mlp_and_input,
    returns=split_mlp,
)
def mlp_parity(ctx, given, got):
    mlp, n = whole_mlp(given[0]["seed"]), ctx.world_size
    x = given[0]["x"].clone().requires_grad_(True)
    out = mlp(x)
    out.square().sum().backward()
    for r in range(n):
        ctx.expect(got[r]["out"], out.detach(), "the output of the split MLP", rank=r, exact=False, **TOLERANCE)
        ctx.expect(
            got[r]["x_grad"],
            x.grad,
            "the gradient of the MLP's input (f's all-reduce in backward)",
            rank=r,
            exact=False,
            **TOLERANCE,
        )
        for name, expected in (
            ("fc.weight", piece(mlp.fc.weight.grad, r, n, 0)),
            ("fc.bias", piece(mlp.fc.bias.grad, r, n, 0)),
            ("proj.weight", piece(mlp.proj.weight.grad, r, n, 1)),
            ("proj.bias", mlp.proj.bias.grad),
        ):
            if got[r]["grads"][name] is None:
                ctx.fail(f"rank {r}: {name} got no gradient")
            ctx.expect(
                got[r]["grads"][name], expected, f"this rank's gradient of {name}", rank=r, exact=False, **TOLERANCE
            )


@check(
    "talk: one all-reduce of b·s·h forward and one backward per MLP, nothing else",
    points=1,
    world_sizes=(2,),
    inputs=mlp_and_input,
    returns={"forward": [COMM], "backward": [COMM]},
)
def talk(ctx, given, got):
    for r in range(ctx.world_size):
        for when in ("forward", "backward"):
            ctx.over_everyone(got[r][when], f"the MLP's {when}", r)
            calls = [(e["name"], e["args"]["numel"]) for e in got[r][when]]
            if calls != [("all_reduce", B * T * D)]:
                ctx.fail(
                    f"rank {r}: the MLP's {when} made the grader's relay carry {calls or 'no collective'}; "
                    f"Megatron's MLP talks once each way: one all_reduce of the (b, s, h) = ({B}, {T}, {D}) "
                    f"activation ({B * T * D} elements), g's in forward and f's in backward"
                )


def gpt_inputs(n, g):
    return {
        "seed": int(torch.randint(0, 2**31, (), generator=g)),
        "batches": [SyntheticCorpus().batch(step, 4) for step in range(2)],
    }


@check(
    "training: a GPT whose MLPs are split trains as one process does",
    points=1,
    world_sizes=(2,),
    inputs=gpt_inputs,
    returns=lambda case, r, n: {
        "losses": List(Tensor((), F32), 2),
        "fc": List(Tensor((4 * D // n, D), F32), 2),
        "qkv": List(Tensor((3 * D, D), F32), 2),
    },
)
def training(ctx, given, got):
    torch.manual_seed(given[0]["seed"])
    reference = tiny_gpt(n_layer=2, d_model=D, n_head=2)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for x, y in given[0]["batches"]:
        loss = reference(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    for r in range(ctx.world_size):
        for step, expected in enumerate(losses):
            mine = got[r]["losses"][step]
            ctx.expect(mine, expected, f"the loss of step {step}", rank=r, exact=False, **TOLERANCE)
        for i, ref in enumerate(reference.blocks):
            ctx.expect(
                got[r]["fc"][i],
                piece(ref.mlp.fc.weight.detach(), r, ctx.world_size, 0),
                f"blocks.{i}.mlp.fc.weight after 2 steps",
                rank=r,
                exact=False,
                **TOLERANCE,
            )
            ctx.expect(
                got[r]["qkv"][i],
                ref.attn.qkv.weight.detach(),
                f"blocks.{i}.attn.qkv.weight after 2 steps (a replicated layer: f's sum reaches it)",
                rank=r,
                exact=False,
                **TOLERANCE,
            )
