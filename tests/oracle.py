"""The one-process oracle that sharded strategies' parity tests compare against: a plain torch loop."""

import torch
import torch.nn as nn


def plain_training(net: nn.Module, batches, optimizer, *, clip=None, mixed=False):
    """Losses, clip norms and final fp32 parameters of `net` trained on `batches`, torch only.

    mixed: the toolkit's recipe done by hand: fp32 master copies of the initial values, a bf16 model,
    16-bit gradients moved onto the masters, the masters stepped and rounded back into the model.
    """
    params = list(net.parameters())
    if mixed:
        masters = [nn.Parameter(p.detach().clone()) for p in params]
        net.to(torch.bfloat16)
    opt = optimizer(masters if mixed else params)
    losses, norms = [], []
    for x, y in batches:
        loss = net(x, y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        if mixed:
            for p, m in zip(params, masters):
                m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        if mixed:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        losses.append(loss.item())
    final = masters if mixed else params
    return losses, norms, {n: t.detach().float().clone() for (n, _), t in zip(net.named_parameters(), final)}
