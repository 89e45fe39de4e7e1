"""The seam the simulator builds on: a pipeline stage's rank runs the same code on torch's fake process group,
with the model on the meta device. Its receives complete without a sender (the fake group moves no data), so
nothing may depend on what a peer sends: shapes are known ahead (`hidden_shape`), and every send and receive
says on its span what it carried, so a simulator can pair the two ends across stages."""

from __future__ import annotations

import pytest
import torch

import toolkit
from toolkit import comm
from toolkit.models import tiny_gpt
from toolkit.sim import cluster
from toolkit.sim.simulate import build_on_meta


def one_simulated_step(rank: int, strategy: str, **options):
    with cluster.cluster(4, rank):
        model = build_on_meta(lambda: tiny_gpt(n_layer=4))
        model, opt = toolkit.parallel.wrap(model, strategy, pp=2, microbatches=4, **options)
        x = torch.empty((8, 32), dtype=torch.long, device="meta")
        issued = []
        with comm.listening(lambda kind, event, tensor: issued.append(event) if kind == "issue" else None):
            loss = model.forward_backward(x, x)
            opt.step()
        return loss, [
            (
                e["name"],
                e["args"].get("message"),
                e["args"].get("micro"),
                e["args"].get("stage"),
                e["args"]["size_bytes"],
            )
            for e in issued
            if e["name"] in ("send", "recv")
        ]


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_a_simulated_stage_runs_the_pipeline_on_the_fake_group(strategy):
    activation = 2 * 32 * 32 * 4  # (b/m, s, d) fp32
    layout = toolkit.parallel.mesh.layout(4, pp=2)  # dp 2 x pp 2, in the mesh's rank order
    first_loss, first = one_simulated_step(layout.rank(pp=0), strategy)  # stage 0 of replica 0
    last_loss, last = one_simulated_step(layout.rank(pp=1), strategy)  # stage 1 of the same replica
    assert first_loss.is_meta and last_loss.is_meta
    assert sorted(m for m in first if m[0] == "send") == sorted(
        [("send", "activation", i, 0, activation) for i in range(4)] + [("send", "tied weight", -1, 0, 64 * 32 * 4)]
    )
    assert sorted(m for m in last if m[0] == "recv") == sorted(
        [("recv", "activation", i, 0, activation) for i in range(4)] + [("recv", "tied weight", -1, 0, 64 * 32 * 4)]
    )
    assert sorted(m[1:] for m in first if m[0] == "recv") == sorted(m[1:] for m in last if m[0] == "send")
