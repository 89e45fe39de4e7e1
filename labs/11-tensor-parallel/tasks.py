"""What every rank runs for lab 11's checks, next to your code: your f and g, your column- and row-parallel
layers and your split MLP, on the whole MLP and input the grader sent (the seed of the MLP, the input), and
what came out (outputs, gradients, the collectives recorded, a split GPT's losses and weights). The grader's
process computes what one process gets and judges (checks.py)."""

import torch
import torch.nn.functional as F

from toolkit.models import tiny_gpt
from toolkit.models.gpt import MLP, GPTConfig

D = 16


def whole_mlp(seed) -> MLP:
    torch.manual_seed(seed)
    return MLP(GPTConfig(d_model=D))  # nn.Linear's own init: the biases are not zero


def piece(t: torch.Tensor, rank, dim: int) -> torch.Tensor:
    return t.chunk(rank.world_size, dim=dim)[rank.rank]


def f_operator(student, rank, given):
    x = given["x"].clone().requires_grad_(True)
    y = student.CopyToTP.apply(x, rank.group)
    (y * (rank.rank + 1)).sum().backward()  # rank r's use of x weighs it r + 1
    return {"y": y.detach(), "grad": x.grad}


def g_operator(student, rank, given):
    x = (given["x"] * (rank.rank + 1)).requires_grad_()
    y = student.ReduceFromTP.apply(x, rank.group)
    after = x.detach().clone()
    (y * 3.0).sum().backward()
    return {"y": y.detach(), "input_after": after, "grad": x.grad}


def column(student, rank, given):
    mlp = whole_mlp(given["seed"])
    layer = student.ColumnParallelLinear(mlp.fc, rank.group)
    start = rank.events_now()
    y = layer(given["x"])
    return {"y": y.detach(), "talked": rank.comm_events(start)}  # what the grader's relay carried


def row(student, rank, given):
    mlp = whole_mlp(given["seed"])
    hidden = F.gelu(mlp.fc(given["x"])).detach()
    layer = student.RowParallelLinear(mlp.proj, rank.group)
    return {"y": layer(piece(hidden, rank, -1)).detach()}


def mlp_parity(student, rank, given):
    split = student.ParallelMLP(whole_mlp(given["seed"]), rank.group)
    x = given["x"].clone().requires_grad_(True)
    out = split(x)
    out.square().sum().backward()
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {
            name: p.grad
            for name, p in (
                ("fc.weight", split.fc.weight),
                ("fc.bias", split.fc.bias),
                ("proj.weight", split.proj.weight),
                ("proj.bias", split.proj.bias),
            )
        },
    }


def talk(student, rank, given):
    split = student.ParallelMLP(whole_mlp(given["seed"]), rank.group)
    start = rank.events_now()
    y = split(given["x"].clone().requires_grad_(True))
    forward = rank.comm_events(start)
    middle = rank.events_now()
    y.sum().backward()
    return {"forward": forward, "backward": rank.comm_events(middle)}


def training(student, rank, given):
    torch.manual_seed(given["seed"])
    model = tiny_gpt(n_layer=2, d_model=D, n_head=2)
    for block in model.blocks:  # attention and the rest stay whole on every rank; the MLPs split
        block.mlp = student.ParallelMLP(block.mlp, rank.group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in given["batches"]:  # every rank of the tensor-parallel group reads the same rows
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {
        "losses": losses,
        "fc": [b.mlp.fc.weight.detach() for b in model.blocks],
        "qkv": [b.attn.qkv.weight.detach() for b in model.blocks],
    }
