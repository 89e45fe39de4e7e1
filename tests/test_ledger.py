"""The memory ledger counts real storage exactly; the activation meter sees what autograd saves."""

import pytest
import torch
import torch.nn as nn

from toolkit.memory import ActivationMeter, ledger, record_memory
from toolkit.trace.events import Recorder, phase


def linear():
    torch.manual_seed(0)
    return nn.Linear(5, 3)  # 15 + 3 = 18 fp32 parameters


def test_params_only_before_backward():
    m = linear()
    assert ledger(m, None) == {"params": 4 * 18, "grads": 0, "optimizer": 0, "total": 4 * 18}


def test_grads_after_backward_and_adam_states_after_step():
    m = linear()
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 5)).sum().backward()
    assert ledger(m, opt)["grads"] == 4 * 18
    assert ledger(m, opt)["optimizer"] == 0  # Adam makes its state lazily, at the first step
    opt.step()
    # exp_avg and exp_avg_sq: 8 bytes per parameter; plus one fp32 `step` scalar per parameter tensor
    # (weight, bias): they are real tensors the optimizer keeps, so they count.
    assert ledger(m, opt)["optimizer"] == 8 * 18 + 2 * 4
    opt.zero_grad()  # set_to_none: the gradients are gone
    assert ledger(m, opt) == {"params": 72, "grads": 0, "optimizer": 152, "total": 224}


def test_sgd_without_momentum_has_no_state():
    m = linear()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 5)).sum().backward()
    opt.step()
    assert ledger(m, opt)["optimizer"] == 0


def test_tied_weight_counts_once():
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    tied = nn.Sequential(a, b)
    assert ledger(tied)["params"] == 4 * 16


class FlatModel(nn.Module):
    """Parameters that are views into one flat buffer, as ZeRO and FSDP lay them out; reports its own groups."""

    def __init__(self, extra=()):
        super().__init__()
        self.flat = torch.zeros(10)
        self.views = [self.flat[:6], self.flat[6:]]
        self.grad_flat = torch.zeros(10, dtype=torch.float16)
        self.extra = list(extra)

    def memory_groups(self):
        groups = {
            "params": list(self.views),
            "grads": [self.grad_flat[:5], self.grad_flat[5:]],
            "optimizer": [self.views[0]],
        }  # a storage already counted as params is not counted again
        if self.extra:
            groups["buckets"] = self.extra
        return groups


def test_views_count_their_storage_once_and_memory_groups_is_used():
    got = ledger(FlatModel(), None)
    assert got == {"params": 40, "grads": 20, "optimizer": 0, "total": 60}


def test_extra_categories_are_reported():
    got = ledger(FlatModel(extra=[torch.zeros(3, dtype=torch.float64)]), None)
    assert got["buckets"] == 24 and got["total"] == 84


def test_storage_resized_to_zero_counts_zero():
    m = linear()
    m.weight.data.untyped_storage().resize_(0)  # how FSDP frees an unsharded parameter
    assert ledger(m)["params"] == 4 * 3


def test_memory_groups_missing_a_category_is_a_clear_error():
    class Bad(nn.Module):
        def memory_groups(self):
            return {"params": []}

    with pytest.raises(ValueError, match="grads"):
        ledger(Bad())


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_activation_meter_counts_saved_tensors_exactly():
    model, x = mlp(), torch.randn(3, 4)
    meter = ActivationMeter(model)
    with meter:
        loss = model(x).pow(2).sum()
    # Saved for backward: x by the first linear (3x4 fp32 = 48 B); tanh's output (3x8 = 96 B), which
    # tanh keeps and the second linear keeps as its input: one storage, counted once; pow's input
    # (3x2 = 24 B). The weights that the linears save are parameters, not activations.
    assert meter.live == 48 + 96 + 24
    assert meter.saved == 3
    loss.backward()
    assert meter.live == 0 and meter.saved == 0
    assert meter.peak == 168


def test_activation_meter_without_model_still_skips_parameters():
    model, x = mlp(), torch.randn(3, 4)
    meter = ActivationMeter()
    with meter:
        loss = model(x).pow(2).sum()
    assert meter.live == 168
    del loss  # the graph is dropped without a backward: autograd lets go of the saved tensors too
    assert meter.live == 0


def test_activation_meter_accumulates_over_micro_batches_and_resets_peak():
    model = mlp()
    meter = ActivationMeter(model)
    for _ in range(2):
        with meter:
            loss = model(torch.randn(3, 4)).pow(2).sum()
        loss.backward()
    assert meter.live == 0 and meter.peak == 168
    with meter:
        a = model(torch.randn(3, 4)).pow(2).sum()
        b = model(torch.randn(3, 4)).pow(2).sum()
    assert meter.live == meter.peak == 2 * 168  # two graphs alive at once
    (a + b).backward()
    meter.reset_peak()
    assert meter.peak == 0


def test_activation_meter_cannot_be_entered_twice():
    meter = ActivationMeter()
    with meter:
        with pytest.raises(RuntimeError, match="already active"):
            meter.__enter__()


def test_record_memory_adds_a_labelled_sample():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    meter, rec = ActivationMeter(model), Recorder()
    with meter:
        loss = model(torch.randn(3, 4)).pow(2).sum()
    with phase("forward"):
        record_memory(model, opt, step=7, meter=meter, recorder=rec)
    (sample,) = rec.samples
    n = sum(p.numel() for p in model.parameters())
    assert sample["phase"] == "forward" and sample["step"] == 7
    assert (sample["params"], sample["grads"], sample["optimizer"], sample["activations"]) == (4 * n, 0, 0, 168)
    loss.backward()
