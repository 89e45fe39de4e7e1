"""Known shapes (`toolkit.sim.known_shapes`): answering a meta operation from one already run changes nothing a
simulation reports, for every kind of layout; and it refuses what a fresh tensor would not reproduce."""

from __future__ import annotations

import pytest
import torch

import toolkit.sim.record as record
from toolkit.models import moe_gpt, tiny_gpt
from toolkit.sim import known_shapes, simulate
from toolkit.sim.known_shapes import KnownShapes

TINY = dict(n_layer=2, d_model=32, n_head=2)
LAYOUTS = {
    "ddp": (tiny_gpt, "ddp", 2, {}),
    "zero1": (tiny_gpt, "zero1", 2, {}),
    "zero2 bf16": (tiny_gpt, "zero2", 2, dict(mixed_precision=True)),
    "zero3": (tiny_gpt, "zero3", 4, {}),
    "fsdp bf16 checkpointed": (tiny_gpt, "fsdp", 4, dict(mixed_precision=True, activation_checkpointing=True)),
    "moe": (lambda **k: moe_gpt(4, 2, **k), "ddp", 4, {}),
    "tp 2": (tiny_gpt, "ddp", 4, dict(tp=2, sequence_parallel=True)),
    "pp 2 1f1b": (tiny_gpt, "local", 2, dict(pp=2, microbatches=4, schedule="1f1b")),
}


def reported(sim) -> tuple:
    """Everything a simulation says of its rank: memory over the step, FLOPs and bytes, the programs."""
    return (
        sim.peak,
        sim.peak_memory,
        sim.memory,
        sim.end_memory,
        sim.flops,
        repr(sim.programs),
        [{k: v for k, v in s.items()} for s in sim.samples],
    )


def run(layout):
    build, strategy, world, options = LAYOUTS[layout]
    return simulate(
        lambda: build(**TINY),
        strategy,
        world,
        rank=world - 1,
        batch_per_rank=4,
        seq_len=32,
        progress=False,
        steps=2,
        **options,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_simulation_reports_the_same_with_and_without_known_shapes(layout, monkeypatch):
    outputs, kernels = known_shapes.Memo(), known_shapes.Memo()
    monkeypatch.setattr(known_shapes, "_OUTPUTS", outputs)
    monkeypatch.setattr(record, "_KERNELS", kernels)
    monkeypatch.setattr(known_shapes, "ENABLED", False)
    without = reported(run(layout))
    assert not outputs and not kernels  # switched off: nothing memoized, every operation computed by torch
    monkeypatch.setattr(known_shapes, "ENABLED", True)
    with_them = reported(run(layout))  # its second step's operations are all known from its first (the warm-up)
    assert outputs and kernels
    assert with_them == without


def test_known_shapes_answer_only_what_a_fresh_tensor_reproduces(monkeypatch):
    monkeypatch.setattr(known_shapes, "_OUTPUTS", known_shapes.Memo())
    a = torch.empty(4, 6, device="meta")
    with KnownShapes() as known:
        for _ in range(3):
            torch.nn.functional.layer_norm(a, (6,))  # pure: run once, then answered
            b = a.t().contiguous()  # a view, then a copy
            a.add_(1)  # mutates: always run
            v = a.view(24)  # aliases: always run
    assert known.hits == 2 * 2  # layer norm and contiguous's clone, on the 2nd and 3rd pass
    assert b.shape == (6, 4) and b.stride() == (4, 1) and b.is_meta
    assert v.untyped_storage()._cdata == a.untyped_storage()._cdata  # the view still shares its storage
    real = torch.ones(3)
    with KnownShapes() as known:
        for _ in range(2):
            out = real * 2  # a real tensor: never answered
    assert known.hits == 0 and out.tolist() == [2.0, 2.0, 2.0]


def test_a_view_returned_without_an_alias_in_its_schema_is_not_memoized(monkeypatch):
    """`_unsafe_view`'s schema declares a new tensor but returns one sharing its input's storage."""
    monkeypatch.setattr(known_shapes, "_OUTPUTS", known_shapes.Memo())
    a = torch.empty(2, 6, device="meta")
    with KnownShapes():
        for _ in range(2):
            out = torch.ops.aten._unsafe_view(a, [12])
            assert out.untyped_storage()._cdata == a.untyped_storage()._cdata
    assert [spec for key, spec in known_shapes._OUTPUTS.items() if key[0] is torch.ops.aten._unsafe_view.default] == [
        None
    ]


def test_a_sparse_meta_tensor_is_left_to_torch(monkeypatch):
    """A sparse tensor has no strides and no storage to compare: its operations run as always."""
    monkeypatch.setattr(known_shapes, "_OUTPUTS", known_shapes.Memo())
    with KnownShapes():
        for _ in range(2):
            s = torch.sparse_coo_tensor(
                torch.empty(2, 0, dtype=torch.long, device="meta"),
                torch.empty(0, device="meta"),
                (3, 3),
                check_invariants=False,
            )
    assert s.layout is torch.sparse_coo and s.shape == (3, 3)
    assert [spec for key, spec in known_shapes._OUTPUTS.items() if "sparse" in str(key[0])] == [None]
