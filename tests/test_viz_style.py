"""One colour per meaning, defined once, readable with colour-vision deficiencies; honest timelines; titles
below the toolbar. (The browser checks the same in the rendered report: tests/test_browser.py.)"""

import itertools
import math
import re
from pathlib import Path

import pytest

from toolkit import viz
from toolkit.run import Run
from toolkit.viz import style

VIZ = Path(viz.__file__).parent


def _linear(channel: int) -> float:
    c = channel / 255
    return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4


def _lab(rgb_linear) -> tuple:
    """CIE L*a*b* (D65) of a linear-RGB colour."""
    r, g, b = (min(1.0, max(0.0, c)) for c in rgb_linear)
    x, y, z = (
        (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047,
        0.2126 * r + 0.7152 * g + 0.0722 * b,
        (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883,
    )
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def seen(colour: str, vision: str | None = None) -> tuple:
    """The colour as a reader sees it (None: typical vision), in L*a*b*."""
    rgb = [_linear(int(colour[i : i + 2], 16)) for i in (1, 3, 5)]
    if vision is not None:
        rgb = [sum(m * c for m, c in zip(row, rgb)) for row in style.CVD_MATRICES[vision]]
    return _lab(rgb)


def closest_pair(colours: dict, vision) -> tuple:
    return min(
        (math.dist(seen(colours[a], vision), seen(colours[b], vision)), a, b)
        for a, b in itertools.combinations(colours, 2)
    )


@pytest.mark.parametrize("vision", [None, "deuteranopia", "protanopia"])
@pytest.mark.parametrize("family", ["COMPUTE", "COMMUNICATION", "MEMORY"])
def test_each_familys_colours_stay_apart(family, vision):
    """ΔE (CIE76) >= 15 between any two colours of a family, for typical vision and the two red-green
    deficiencies: at a glance, different (20 is clearly different, 2 is the smallest difference seen)."""
    distance, a, b = closest_pair(getattr(style, family), vision)
    assert distance >= 15, f"{family}: {a} and {b} are only ΔE {distance:.1f} apart for {vision or 'typical'} vision"


def test_the_simulation_sees_what_deuteranopes_see():
    """Red and green, far apart for most readers, nearly merge under the deuteranopia matrix (a test of the test)."""
    red, green = "#D62728", "#2CA02C"
    assert math.dist(seen(red), seen(green)) > 80
    assert math.dist(seen(red, "deuteranopia"), seen(green, "deuteranopia")) < 25


def test_colours_are_defined_once():
    """No figure module writes a colour of its own: each takes it from style."""
    for path in VIZ.glob("*.py"):
        if path.name in ("style.py", "report.py"):  # report.py: the page's CSS, not a figure
            continue
        found = re.findall(r"#[0-9a-fA-F]{6}\b|color=\"(?:black|grey|gray|white|red)\"", path.read_text())
        assert not found, f"{path.name} writes colours itself: {found}"


def test_compute_categories_and_shades():
    """A name always gets the same colour: its category's, in a shade fixed by the name alone."""
    assert [
        style.compute_category({"name": n, "cat": c, "args": a})
        for n, c, a in [
            ("forward", "compute", {}),
            ("forward blocks.0", "fsdp", {}),
            ("backward (root)", "fsdp", {}),
            ("optimizer", "compute", {}),
            ("wait", "wait", {}),
            ("wait", "wait", {"emulated": True}),
            ("moe/layer0/experts", "compute", {}),
            ("prepare inputs", "compute", {}),
        ]
    ] == ["forward", "forward", "backward", "optimizer", "wait", "emulated", "experts", "other"]
    family = [style.compute_colour(n) for n in ("forward", "forward (root)", "forward blocks.0", "forward blocks.1")]
    assert family[0] == style.COMPUTE["forward"] and len(set(family)) == 4
    assert style.compute_colour("optimizer") == style.COMPUTE["optimizer"]
    assert style.compute_colour(style.BLOCKED + "all_reduce") == style.shade(
        style.COMPUTE["wait"], style.variant(style.BLOCKED + "all_reduce", "wait")
    )
    assert (
        style.comm_colour("all_to_all · dispatch")
        != style.comm_colour("all_to_all")
        == style.COMMUNICATION["all_to_all"]
    )
    assert style.shade("#808080", 1) > "#808080" > style.shade("#808080", 2)  # lighter, then darker


def _span(rank, name, cat, start, end, **args):
    return {"name": name, "cat": cat, "phase": "", "rank": rank, "start": start, "end": end, "args": args}


def test_the_timeline_shows_blocking_collectives_as_waiting():
    """Naive data parallelism: synchronous all-reduces inside the backward span. The compute lane shows that
    time as blocked, and the subtitle says how much overlapped (none)."""
    events = []
    for rank in (0, 1):
        events += [
            _span(rank, "forward", "compute", 0.0, 0.010),
            _span(rank, "backward", "compute", 0.010, 0.050),
            _span(rank, "all_reduce", "comm", 0.030, 0.040, async_op=False, impl="backend"),
            _span(rank, "all_reduce", "comm", 0.042, 0.050, async_op=False, impl="backend"),
            _span(rank, "optimizer", "compute", 0.050, 0.055),
        ]
    fig = viz.timeline(Run(config={}, events=events, meta={"ranks": [0, 1], "world_size": 2}))
    traces = {t.name: t for t in fig.data}
    blocked = traces["wait in all_reduce"]
    assert list(blocked.y) == ["rank 0 · compute"] * 2 + ["rank 1 · compute"] * 2
    assert list(blocked.x) == pytest.approx([10.0, 8.0, 10.0, 8.0])  # ms, the collectives' own lengths
    assert [t.name for t in fig.data][-1] == "wait in all_reduce"  # drawn over the backward span
    assert blocked.marker.color in {style.shade(style.COMPUTE["wait"], k) for k in range(3)}  # waiting's colours
    assert traces["backward"].marker.color == style.COMPUTE["backward"]
    greys = {
        name
        for name, t in traces.items()
        if t.marker.color in {style.shade(style.COMPUTE["wait"], k) for k in range(12)}
    }
    assert greys and all(name.startswith("wait") for name in greys), greys  # grey says "wait" in every figure
    assert (
        "overlapped with computation: 0%" in fig.layout.title.subtitle.text
        and "blocked" in fig.layout.title.subtitle.text
    )


def test_titles_sit_below_the_toolbar_and_long_ones_wrap():
    fig = style.place_title(viz.ring_schedule(4).update_layout(), "a " * 60, "b " * 80)
    assert fig.layout.title.yref == "container" and fig.layout.title.pad.t == style.TOOLBAR_PX
    assert fig.layout.title.text.count("<br>") == 1 and fig.layout.title.subtitle.text.count("<br>") == 1
    assert fig.layout.margin.t == style.TOOLBAR_PX + 2 * style.TITLE_PX + 2 * style.SUBTITLE_PX + 16


def test_a_pass_s_units_share_one_name_and_colour_and_each_bar_is_named():
    """The trial: FSDP/HSDP timelines drew 8-12 near-identical blues, one legend entry per unit. A pass's units
    are now one trace in one shade ("forward · units"), each bar named by its unit and edged, so neighbours part."""
    events = [_span(0, "forward", "compute", 0.0, 0.012), _span(0, "backward", "compute", 0.012, 0.036)]
    for i in range(12):
        events.append(_span(0, f"forward blocks.{i}", "fsdp", 0.001 * i, 0.001 * (i + 1)))
        events.append(_span(0, f"backward blocks.{11 - i}", "fsdp", 0.012 + 0.002 * i, 0.012 + 0.002 * (i + 1)))
    events.append(_span(0, "all_gather", "comm", 0.0, 0.001, async_op=True, impl="backend"))
    fig = viz.timeline(Run(config={}, events=events, meta={"ranks": [0], "world_size": 1}))
    traces = {t.name: t for t in fig.data}
    assert not any(re.search(r"blocks\.\d", name) for name in traces), list(traces)
    for pass_ in ("forward", "backward"):
        units = traces[f"{pass_} · units"]
        assert list(units.text) == [f"blocks.{i}" for i in (range(12) if pass_ == "forward" else range(11, -1, -1))]
        assert units.marker.color == style.compute_colour(f"{pass_} · units") != style.COMPUTE[pass_]
        assert units.marker.line.width >= 1.5 and units.marker.line.color == style.SEPARATOR
        distance = math.dist(seen(units.marker.color), seen(style.COMPUTE[pass_]))
        assert distance >= 10, f"{pass_}'s units are only ΔE {distance:.1f} from the pass's own span"


def test_the_simulated_peaks_categories_have_colours_of_their_own():
    for category in ("gathered", "comm", "temporary"):
        assert category in style.MEMORY  # test_each_familys_colours_stay_apart measures them with the rest
