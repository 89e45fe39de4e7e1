"""The graded checks of lab 11 (tensor parallelism). Each runs on every rank of a real job (2 ranks).

Every rank builds the same whole MLP (d 16 -> 64 -> GELU -> 16, the toolkit GPT's `MLP`, biases not zero)
and the same input; the student's split layers must reproduce what the whole layers compute on one
process, in forward and backward, talking only where Megatron's f and g talk.
"""
import copy

import torch
import torch.nn.functional as F

from toolkit.grading import check
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.models.gpt import MLP, GPTConfig
from toolkit.trace.events import recorder

D, B, T = 16, 2, 8
TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # fp32: the split sums add t partial sums in another order


def whole_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(GPTConfig(d_model=D))  # nn.Linear's own init: the biases are not zero


def inputs() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(B, T, D, requires_grad=True)


def comm_events(start: int) -> list:
    return [e for e in recorder.events[start:] if e["cat"] == "comm"]


def piece(t: torch.Tensor, ctx, dim: int) -> torch.Tensor:
    return t.chunk(ctx.world_size, dim=dim)[ctx.rank]


@check("f: identity forward, the gradients of every rank summed in backward", points=1, world_sizes=(2,))
def f_operator(student, ctx):
    x = inputs()
    y = student.CopyToTP.apply(x, ctx.group)
    ctx.expect(y.detach(), x.detach(), "f(x) in forward")
    (y * (ctx.rank + 1)).sum().backward()  # rank r's use of x weighs it r + 1
    expected = torch.full_like(x, sum(r + 1 for r in range(ctx.world_size)))
    if x.grad is not None and torch.allclose(x.grad, torch.full_like(x, ctx.rank + 1.0)):
        ctx.fail(f"rank {ctx.rank}: f's backward returned this rank's gradient only; every rank used x, so its "
                 "gradient is the sum of theirs: all-reduce it")
    ctx.expect(x.grad, expected, "the gradient of x through f")


@check("g: every rank's partial result summed in forward, identity in backward", points=1, world_sizes=(2,))
def g_operator(student, ctx):
    x = (inputs().detach() * (ctx.rank + 1)).requires_grad_()
    y = student.ReduceFromTP.apply(x, ctx.group)
    total = inputs().detach() * sum(r + 1 for r in range(ctx.world_size))
    ctx.expect(y.detach(), total, "g(x) in forward", exact=False, **TOLERANCE)
    if not torch.equal(x.detach(), inputs().detach() * (ctx.rank + 1)):
        ctx.fail(f"rank {ctx.rank}: g changed its input in place; all-reduce a copy (autograd may need the input)")
    (y * 3.0).sum().backward()
    if x.grad is not None and torch.allclose(x.grad, torch.full_like(x, 3.0 * ctx.world_size)):
        ctx.fail(f"rank {ctx.rank}: g's backward all-reduced the gradient too; the output's gradient is already the "
                 "same on every rank, so g passes it through unchanged")
    ctx.expect(x.grad, torch.full_like(x, 3.0), "the gradient of x through g")


@check("column-parallel forward: this rank's output features, no talk", points=1, world_sizes=(2,))
def column(student, ctx):
    mlp, x = whole_mlp(), inputs()
    layer = student.ColumnParallelLinear(mlp.fc, ctx.group)
    start = len(recorder.events)
    y = layer(x)
    talked = comm_events(start)
    if talked:
        ctx.fail(f"rank {ctx.rank}: the column-parallel forward issued {[e['name'] for e in talked]}: a "
                 "column-parallel layer needs no talk in forward (each rank computes its own output features from "
                 "the whole input); an all-reduce there adds up features that belong to different columns. Its "
                 "collective is f's, in backward")
    ctx.expect(y.detach(), piece(mlp.fc(x).detach(), ctx, -1), "this rank's output features", exact=False,
               **TOLERANCE)


@check("row-parallel forward: the whole output, the bias added once", points=1, world_sizes=(2,))
def row(student, ctx):
    mlp, x = whole_mlp(), inputs()
    hidden = F.gelu(mlp.fc(x)).detach()
    layer = student.RowParallelLinear(mlp.proj, ctx.group)
    y = layer(piece(hidden, ctx, -1)).detach()
    expected = mlp.proj(hidden).detach()
    extra = (ctx.world_size - 1) * mlp.proj.bias.detach()
    if torch.allclose(y, expected + extra, **TOLERANCE):
        ctx.fail(f"rank {ctx.rank}: the output holds the bias {ctx.world_size} times: every rank added it before "
                 "the all-reduce summed their partial results. Add the bias once, after g")
    ctx.expect(y, expected, "the row-parallel layer's output", exact=False, **TOLERANCE)


@check("the split MLP: its output and every gradient equal the whole MLP's", points=2, world_sizes=(2,))
def mlp_parity(student, ctx):
    mlp, x = whole_mlp(), inputs()
    split = student.ParallelMLP(mlp, ctx.group)
    split(x).square().sum().backward()
    dx = x.grad.clone()
    x.grad = None
    out = mlp(x)
    out.square().sum().backward()
    ctx.expect(split(x).detach(), out.detach(), "the output of the split MLP", exact=False, **TOLERANCE)
    ctx.expect(dx, x.grad, "the gradient of the MLP's input (f's all-reduce in backward)", exact=False, **TOLERANCE)
    for name, got, expected in (("fc.weight", split.fc.weight.grad, piece(mlp.fc.weight.grad, ctx, 0)),
                                ("fc.bias", split.fc.bias.grad, piece(mlp.fc.bias.grad, ctx, 0)),
                                ("proj.weight", split.proj.weight.grad, piece(mlp.proj.weight.grad, ctx, 1)),
                                ("proj.bias", split.proj.bias.grad, mlp.proj.bias.grad)):
        if got is None:
            ctx.fail(f"rank {ctx.rank}: {name} got no gradient")
        ctx.expect(got, expected, f"this rank's gradient of {name}", exact=False, **TOLERANCE)


@check("talk: one all-reduce of b·s·h forward and one backward per MLP, nothing else", points=1, world_sizes=(2,))
def talk(student, ctx):
    split, x = student.ParallelMLP(whole_mlp(), ctx.group), inputs()
    start = len(recorder.events)
    y = split(x)
    forward = comm_events(start)
    middle = len(recorder.events)
    y.sum().backward()
    backward = comm_events(middle)
    for when, events in (("forward", forward), ("backward", backward)):
        calls = [(e["name"], e["args"]["numel"]) for e in events]
        if calls != [("all_reduce", B * T * D)]:
            ctx.fail(f"rank {ctx.rank}: the MLP's {when} issued {calls or 'no collective'} through toolkit.comm; "
                     f"Megatron's MLP talks once each way: one all_reduce of the (b, s, h) = ({B}, {T}, {D}) "
                     f"activation ({B * T * D} elements), g's in forward and f's in backward")


@check("training: a GPT whose MLPs are split trains as one process does", points=1, world_sizes=(2,))
def training(student, ctx):
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=2, d_model=D, n_head=2)
    reference = copy.deepcopy(model)
    for block in model.blocks:  # attention and the rest stay whole on every rank; the MLPs split
        block.mlp = student.ParallelMLP(block.mlp, ctx.group)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    corpus = SyntheticCorpus()
    for step in range(2):
        x, y = corpus.batch(step, 4)  # every rank of the tensor-parallel group reads the same rows
        loss, ref_loss = model(x, y), reference(x, y)
        loss.backward()
        ref_loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        ctx.expect(loss.detach(), ref_loss.detach(), f"the loss of step {step}", exact=False, **TOLERANCE)
    for i, (block, ref) in enumerate(zip(model.blocks, reference.blocks)):
        ctx.expect(block.mlp.fc.weight.detach(), piece(ref.mlp.fc.weight.detach(), ctx, 0),
                   f"blocks.{i}.mlp.fc.weight after 2 steps", exact=False, **TOLERANCE)
        ctx.expect(block.attn.qkv.weight.detach(), ref.attn.qkv.weight.detach(),
                   f"blocks.{i}.attn.qkv.weight after 2 steps (a replicated layer: f's sum reaches it)",
                   exact=False, **TOLERANCE)
