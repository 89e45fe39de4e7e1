"""Figures are pure functions of hand-made Runs and records: right traces, lanes, hover text; reports stand alone."""

import re

import plotly.graph_objects as go
import pytest

from toolkit import viz
from toolkit.comm.measure import bus_factor, format_table, table_rows
from toolkit.memory import alpha_beta_time
from toolkit.run import Run
from toolkit.viz.style import COMMUNICATION as OPERATION_COLOURS


def _comm(rank, name, start, end, impl="backend", size=4096, phase="all_reduce/backend/4 KiB", group=(0, 1)):
    return {
        "name": name,
        "cat": "comm",
        "phase": phase,
        "rank": rank,
        "start": start,
        "end": end,
        "args": {
            "op": "sum",
            "group": list(group),
            "dtype": "float32",
            "numel": size // 4,
            "size_bytes": size,
            "bytes_sent": size,
            "bytes_recv": size,
            "impl": impl,
        },
    }


def _compute(rank, name, start, end):
    return {"name": name, "cat": "compute", "phase": "prepare", "rank": rank, "start": start, "end": end, "args": {}}


@pytest.fixture
def run():
    events = []
    for rank in (0, 1):
        events += [
            _compute(rank, "prepare inputs", 100.0, 100.001),
            _comm(rank, "all_reduce", 100.001, 100.002),  # 4 KiB in 1 ms
            _comm(rank, "all_gather", 100.003, 100.005, impl="ring", size=8192, phase="all_gather/ring/8 KiB"),
        ]
    return Run(config={}, events=events, meta={"ranks": [0, 1], "world_size": 2})


def _record(op, impl, size, seconds, n=4, agree=True):
    algbw = size / seconds
    return {
        "op": op,
        "impl": impl,
        "algorithm": impl,
        "size_bytes": size,
        "world_size": n,
        "seconds": seconds,
        "seconds_min": seconds * 0.9,
        "seconds_max": seconds * 1.2,
        "repeats": 3,
        "algbw": algbw,
        "busbw": algbw * bus_factor(op, n),
        "agree": agree,
        "max_abs_diff": 0.0,
    }


@pytest.fixture
def records():
    alpha, beta = 50e-6, 1 / 2e9
    out = []
    for op in ("all_reduce", "all_gather", "broadcast"):
        for impl in ("backend", "ring") if op != "broadcast" else ("backend",):
            for size in (4096, 65536, 1 << 20):
                slow = 1.0 if impl == "ring" else 0.8
                out.append(_record(op, impl, size, alpha_beta_time(op, size, 4, alpha, beta) / slow))
    return out


# --- timeline ---------------------------------------------------------------------------------------
def test_timeline_has_a_comm_and_a_compute_lane_per_rank(run):
    fig = viz.timeline(run)
    assert list(fig.layout.yaxis.categoryarray) == [
        "rank 0 · comm",
        "rank 0 · compute",
        "rank 1 · comm",
        "rank 1 · compute",
    ]
    lanes_by_trace = {t.name: set(t.y) for t in fig.data}
    assert lanes_by_trace["all_reduce"] == {"rank 0 · comm", "rank 1 · comm"}
    assert lanes_by_trace["prepare inputs"] == {"rank 0 · compute", "rank 1 · compute"}


def test_timeline_colours_by_operation_and_hatches_hand_written(run):
    fig = viz.timeline(run)
    traces = {t.name: t for t in fig.data}
    assert set(traces) == {"all_reduce", "all_gather (ring)", "prepare inputs"}
    assert traces["all_reduce"].marker.color == OPERATION_COLOURS["all_reduce"]
    assert traces["all_gather (ring)"].marker.color == OPERATION_COLOURS["all_gather"]
    assert traces["all_reduce"].marker.pattern.shape in ("", None)
    assert traces["all_gather (ring)"].marker.pattern.shape == "/"


def test_timeline_spans_start_and_last_where_recorded(run):
    bars = {t.name: t for t in viz.timeline(run).data}["all_reduce"]
    assert list(bars.base) == pytest.approx([1.0, 1.0])  # ms after the first span
    assert list(bars.x) == pytest.approx([1.0, 1.0])  # 1 ms long


def test_timeline_hover_shows_bytes_duration_and_bandwidth(run):
    hover = {t.name: t for t in viz.timeline(run).data}["all_reduce"].hovertext[0]
    assert "size 4 KiB" in hover and "sent 4 KiB" in hover and "received 4 KiB" in hover
    assert "duration 1.000 ms" in hover
    assert "algbw 4.1 MB/s" in hover and "0.0" not in hover  # 4096 B / 1 ms, in the unit it calls for
    assert "busbw 4.1 MB/s" in hover  # all-reduce on 2 ranks: factor 2(2-1)/2 = 1


def test_timeline_filters(run):
    only_comm = viz.timeline(run, include_compute=False)
    assert list(only_comm.layout.yaxis.categoryarray) == ["rank 0 · comm", "rank 1 · comm"]
    gathers = viz.timeline(run, phase="all_gather/")
    assert [t.name for t in gathers.data] == ["all_gather (ring)"]
    rank1 = viz.timeline(run, ranks=[1])
    assert all(label.startswith("rank 1") for t in rank1.data for label in t.y)


def test_timeline_of_an_empty_run_is_an_empty_figure():
    fig = viz.timeline(Run(meta={"ranks": [0]}))
    assert isinstance(fig, go.Figure) and len(fig.data) == 0


# --- bandwidth ---------------------------------------------------------------------------------------
def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("reduce_scatter", 4) == bus_factor("all_gather", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError):
        bus_factor("gossip", 4)


def test_bandwidth_has_a_panel_per_operation_and_a_line_per_impl_and_metric(records):
    fig = viz.bandwidth(records)
    assert [a.text for a in fig.layout.annotations] == ["all_reduce", "all_gather", "broadcast"]
    names = [t.name for t in fig.data]
    assert len(names) == 2 * 2 + 2 * 2 + 1 * 2  # impls x metrics per op
    assert set(names) == {"backend algbw", "backend busbw", "hand-written algbw", "hand-written busbw"}
    assert fig.layout.xaxis.type == "log"
    ring_busbw = next(t for t in fig.data if t.name == "hand-written busbw")  # the first panel: all_reduce
    expected = [r["busbw"] / 1e9 for r in records if r["op"] == "all_reduce" and r["impl"] == "ring"]
    assert list(ring_busbw.y) == pytest.approx(expected)
    assert "busbw" in ring_busbw.hovertext[0] and "agrees" in ring_busbw.hovertext[0]


def test_fit_recovers_the_model_it_was_made_from(records):
    alpha, beta = viz.fit_alpha_beta(records, impl="ring")
    assert alpha == pytest.approx(50e-6, rel=1e-6)
    assert beta == pytest.approx(1 / 2e9, rel=1e-6)


def test_model_line_is_added_per_panel(records):
    fig = viz.bandwidth(records, model="fit", metrics=("busbw",))
    model = [t for t in fig.data if t.legendgroup == "model"]
    assert len(model) == 3 and sum(bool(t.showlegend) for t in model) == 1
    assert "alpha-beta model (α = 50 µs" in model[0].name
    times = viz.collective_times(records, model=(50e-6, 1 / 2e9))
    assert times.layout.yaxis.type == "log"
    assert sum(t.legendgroup == "model" for t in times.data) == 3


def test_bandwidth_rejects_unknown_metrics(records):
    with pytest.raises(ValueError, match="metrics"):
        viz.bandwidth(records, metrics=("goodput",))


def test_bandwidth_takes_a_run_that_carries_records(records):
    run = Run(metrics=[{"name": "collective_timing", "step": None, "value": r, "rank": 0} for r in records])
    assert len(viz.bandwidth(run).data) == len(viz.bandwidth(records).data)


def test_table_rows_are_plain_strings(records):
    rows = table_rows(records[:1])
    assert rows[0]["operation"] == "all_reduce" and rows[0]["size"] == "4 KiB"
    text = format_table(records)
    assert text.splitlines()[0].split() == [
        "operation",
        "implementation",
        "size",
        "time",
        "algbw",
        "busbw",
        "agreement",
    ]


# --- the ring schedule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_schedule_reduces_then_gathers_every_chunk(n):
    holdings = [[{r} for _ in range(n)] for r in range(n)]
    steps = viz.ring_steps(n)
    for half in ("reduce-scatter", "all-gather"):
        for s in range(1, n):
            moves = [m for m in steps if m["half"] == half and m["step"] == s]
            assert sorted(m["rank"] for m in moves) == list(range(n))  # everyone sends once per step
            sent = [(m["to"], m["chunk"], set(holdings[m["rank"]][m["chunk"]])) for m in moves]
            for m in moves:  # what arrives is what the left neighbour sent
                left = next(x for x in moves if x["rank"] == m["from"])
                assert left["chunk"] == m["received"]
            for to, chunk, contents in sent:
                holdings[to][chunk] = holdings[to][chunk] | contents if half == "reduce-scatter" else contents
        if half == "reduce-scatter":
            assert all(holdings[r][r] == set(range(n)) for r in range(n))
    assert all(h == set(range(n)) for row in holdings for h in row)
    fig = viz.ring_schedule(n)
    assert len(fig.data[0].x) == 2 * (n - 1)


# --- report -----------------------------------------------------------------------------------------------
def test_report_is_self_contained(tmp_path, records, run):
    path = viz.write_report(
        tmp_path / "sub" / "report.html",
        "A <test> report",
        [
            "plain <b>text</b>",
            viz.heading("Numbers"),
            table_rows(records),
            viz.bandwidth(records),
            viz.timeline(run),
            viz.preformatted(format_table(records)),
        ],
    )
    html = open(path, encoding="utf-8").read()
    assert not re.search(r"<script[^>]*src=[\"']?https?:", html)
    assert html.count("Plotly.newPlot") == 2  # two figures
    assert len(re.findall(r"plotly\.js v\d", html)) == 1  # the library inlined exactly once
    assert len(html) > 1_000_000  # ... really inlined, not referenced
    assert "A &lt;test&gt; report" in html and "plain &lt;b&gt;text&lt;/b&gt;" in html
    assert "<th>operation</th>" in html and "<td>all_reduce</td>" in html


def test_report_without_figures_has_no_plotly():
    html = viz.report_html("Just text", ["hello"])
    assert "<script" not in html


def test_report_rejects_what_it_cannot_draw():
    with pytest.raises(TypeError, match="report block"):
        viz.report_html("x", [object()])


# --- panel ------------------------------------------------------------------------------------------------
def test_panel_builds_without_launching_and_redraws_on_launch(run, records):
    calls = []

    def fake_measure(**settings):
        calls.append(settings)
        return records, run

    panel = viz.collective_panel(fake_measure, world_sizes=(2, 4))
    assert calls == []  # building runs nothing
    panel.operation.value, panel.world_size.value, panel.implementation.value = "all_gather", 2, "ring"
    panel.button.click()
    assert calls == [
        {
            "world_size": 2,
            "ops": ("all_gather",),
            "sizes": (panel.size.value,),
            "impls": ("ring",),
            "warmup": 1,
            "repeats": 3,
        }
    ]
    assert isinstance(panel.figure, go.Figure) and len(panel.figure.data) == 3
    assert panel.records is records and "done" in panel.status.value and not panel.button.disabled
    assert "application/vnd.jupyter.widget-view+json" in panel._repr_mimebundle_()


def test_panel_reports_a_failed_launch():
    def broken(**_):
        raise RuntimeError("rank 1 raised")

    panel = viz.collective_panel(broken)
    panel.launch()
    assert "failed" in panel.status.value and panel.figure is None and not panel.button.disabled


# --- a simulated rank's peak, and a sweep --------------------------------------------------------------------
def test_peak_bars_draw_every_category_of_the_peak_in_the_unit_its_size_calls_for():
    """The trial: the lesson's chart said MB while its values were GB, and drew ~2 GB of params, grads, optimizer
    and activations against a printed 17.7 GB peak: gathered units, communication buffers and temporaries were
    left out. Every category at the peak is drawn, and they add up to it."""
    peak = {
        "params": 0.06e9,
        "gathered": 8.53e9,
        "grads": 0,
        "optimizer": 0.12e9,
        "comm": 3.62e9,
        "activations": 1.31e9,
        "temporary": 4.1e9,
    }
    fig = viz.peak_bars({"fsdp": peak}, capacity=80 * 2**30, device="A100", predicted={"fsdp": 0.25e9})
    bars = {t.name: t.y[0] for t in fig.data if t.type == "bar"}
    assert set(bars) == {k for k, v in peak.items() if v}
    assert sum(bars.values()) == pytest.approx(sum(peak.values()) / 1e9)  # GB, and the axis says so
    assert (
        fig.layout.yaxis.title.text == "GB per rank"
        and "peak 17.7 GB" in next(t for t in fig.data if t.type == "scatter" and t.mode == "text").text[0]
    )
    assert [s.y0 for s in fig.layout.shapes] == [pytest.approx(80 * 2**30 / 1e9)]
    tiny = viz.peak_bars({"ddp": {"params": 5090, "activations": 27100}})
    assert tiny.layout.yaxis.title.text == "kB per rank" and not tiny.layout.shapes
    bars = viz.memory_bars(
        {
            "x": Run(
                config={},
                samples=[{"rank": 0, "params": 2e9, "grads": 2e9, "optimizer": 12e9, "activations": 1e9, "time": 0}],
                meta={"ranks": [0]},
            )
        }
    )
    assert bars.layout.yaxis.title.text == "GB per rank" and bars.data[0].y[0] == pytest.approx(2)
    assert fig.layout.annotations[0].text == "A100: 85.9 GB (80 GiB)"  # and the GiB it is sold by
    theory = viz.model_states_bars(1e5, 4)  # the theory's bars: a tiny model in kB and MB, not "0.0 GB"
    assert theory.layout.yaxis.title.text == "MB per rank" and theory.data[-1].text[0] == "1.6 MB"


def test_a_sweep_figure_draws_what_does_not_fit_hollow_and_says_so_only_then():
    from types import SimpleNamespace

    fit = SimpleNamespace(capacity=85.9e9)
    row = lambda label, w, fits, rate: dict(
        label=label,
        world_size=w,
        fits=fits,
        tflops_per_gpu=rate if fits else None,  # noqa: E731
        peak=120e9 if not fits else 10e9,
        fit=fit,
        step_time=0.3 if fits else None,
        breakdown=dict(exposed_comm=0.01),
    )
    rows = [
        row("ddp", 8, False, None),
        row("ddp", 1024, False, None),
        row("fsdp", 8, True, 133),
        row("fsdp", 1024, True, 68),
    ]
    fig = viz.scaling(rows)
    ddp, fsdp = fig.data
    assert list(ddp.marker.symbol) == ["circle-open"] * 2 and list(ddp.y) == [0, 0]
    assert list(fsdp.marker.symbol) == ["circle"] * 2 and list(fsdp.y) == [133, 68]
    assert "does not fit" in fig.layout.title.subtitle.text and "does not fit: peak 120 GB" in ddp.hovertext[0]
    assert "does not fit" not in viz.scaling(rows[2:]).layout.title.subtitle.text
