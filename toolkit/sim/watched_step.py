"""One training step, watched: what a rank ran (its program), what it held (memory) and what it computed.

`train_step` runs a step in `toolkit.train`'s phases and spans; `measure_steps` runs steps under two counters
(MemTracker's memory by category, `memory.py`; the op counter's FLOPs, bytes and kernels, `record.py`) while the
collectives door cuts the work into a program (`program.py`). It works on any process group: on the simulated
cluster with meta tensors (`simulate`, and the calibration's reference step) or on a real one (the tests hold the
simulation to a real gloo run this way). `loss_fn(model, x, y)` says how the model is called
(`toolkit.models.protocol`; default `model(x, y)`).
"""

from __future__ import annotations

import contextlib

from .. import comm
from ..memory.ledger import ledger
from ..trace.events import phase, recorder, span
from .known_shapes import KnownShapes
from .memory import StepMemory
from .record import OpCounter, Programmer


def train_step(
    model, opt, x, y, *, step: int, bar=None, after=None, updated=None, loss_fn=None, accumulation=1, no_sync=True
) -> None:
    """One training step in `toolkit.train`'s phases and spans; `after(label)` ends each phase, and
    `updated()` runs between the optimizer's update and `zero_grad` (every model state alive). With
    `accumulation` = M the batch is M micro-batches, each a forward and a backward of loss/M, all but the last
    inside `model.no_sync()` (where the strategy has one, unless no_sync=False), as `toolkit.train` runs them."""
    if hasattr(model, "pipeline"):  # pp > 1: the schedule runs forward and backward of every micro-batch
        with span("forward_backward", step=step):  # (its actions are spans of their own, in their phases)
            model.forward_backward(x, y)
        if after is not None:
            after(None)
    else:
        batches = zip(x.chunk(accumulation), y.chunk(accumulation)) if accumulation > 1 else [(x, y)]
        for micro, (xm, ym) in enumerate(batches):
            quiet = no_sync and micro < accumulation - 1 and hasattr(model, "no_sync")
            with model.no_sync() if quiet else contextlib.nullcontext():
                for name in ("forward", "backward"):
                    with phase(name):
                        with span(name, step=step, micro=micro):
                            if name == "forward":
                                loss = model(xm, ym) if loss_fn is None else loss_fn(model, xm, ym)
                            else:
                                (loss if accumulation == 1 else loss / accumulation).backward()
                                del loss
                        if after is not None:
                            after(None)
                    if bar is not None:
                        bar.update()
    with phase("optimizer"):
        with span("optimizer", step=step):
            opt.step()
            if updated is not None:
                updated()
            opt.zero_grad()
        if after is not None:
            after("optimizer")
    if bar is not None:
        bar.update()


def measure_steps(model, opt, x, y, steps: int, *, bar=None, meta: bool = False, first: int = 0, **loop) -> dict:
    """Train `steps` steps on (x, y) as `toolkit.train` does, watched: programs, memory, FLOPs. loop: `train_step`'s
    loss_fn, accumulation and no_sync.

    Works on any process group: on the simulated cluster (meta tensors, `meta=True` so the ledger counts
    them) or on a real one. Returns the fields of a `Simulation` that a step produces.
    """
    memory, ops = StepMemory(), OpCounter(meta=meta)
    programmer = Programmer(ops, memory.module)

    def door(kind, event, tensor):
        programmer(kind, event)
        if tensor is not None:
            memory.communicated(tensor)
        if bar is not None:
            bar.set_postfix_str(f"{event['phase']}: {event['name']} {event['args'].get('unit', '')}", refresh=False)

    programs, samples, states = [], [], {}
    memory.classify(model, opt)
    with contextlib.ExitStack() as stack:
        below = (KnownShapes(),) if meta else ()  # first in, so the memory tracker and the counter see all
        for context in (*below, memory, ops, comm.listening(door), recorder.listening(programmer.span)):
            stack.enter_context(context)
        for step in range(first, first + steps):
            memory.reset_mod_stats()  # MemTracker counts one iteration at a time
            programmer.start_step()

            def boundary(label=None, step=step):  # the end of a phase: cut the program, sample memory
                programmer.cut(label)
                memory.classify(model, opt)  # what the phase made that the strategy keeps (DDP's rebuilt
                samples.append(_sample(memory, step))  # buckets in forward, ZeRO's reduced slices) is its own

            def update():  # the model states, as the formulas count them: all of them alive
                states.update(ledger(model, opt, meta=meta))

            train_step(model, opt, x, y, step=step, bar=bar, after=boundary, updated=update, **loop)
            memory.classify(model, opt)  # what the strategy's tensors are after the step
            programs.append(programmer.end_step())
    return {
        "programs": programs,
        "memory": states,
        "peak": memory.peak_total,
        "peak_memory": memory.peak_categories,
        "peak_moment": memory.peak_moment,
        "moments": memory.moments,
        "end_memory": memory.current(),
        "samples": samples,
    }


def _sample(memory: StepMemory, step: int) -> dict:
    """One memory sample into the trace (as `record_memory` does on real runs), with the viz's keys."""
    now = memory.current()
    sample = {
        "params": now["params"] + now["gathered"],
        "grads": now["grads"],
        "optimizer": now["optimizer"],
        "activations": now["activations"],
        **{f"sim_{k}": v for k, v in now.items()},
    }
    recorder.sample(step=step, **sample)
    return dict(now, phase=recorder.samples[-1]["phase"] if recorder.samples else "", step=step)
