"""The look every figure shares: one colour per meaning, and a title that clears the toolbar.

One colour per meaning: "forward" is the same sky blue in every timeline, "all_gather" the same mint,
whichever figure, lesson or report draws it, so a student learns the colours once. Three families,
each drawn in its own place: what a rank computes (the compute lane of a timeline), what it sends (the
communication lane) and what its memory holds (memory bars and curves). "optimizer" is one green for
its step and for its states.

The colours come from Paul Tol's colour-blind-safe schemes and were chosen so that every two colours
of a family stay apart for readers with deuteranopia or protanopia as well as for everyone else
(tests/test_viz_style.py measures it with `CVD_MATRICES`; tests/test_browser.py screenshots the report
as a deuteranope sees it). Names that refine a category ("forward blocks.0", "all_to_all · dispatch") get shades of
its colour, each name always the same shade, so the family still reads at a glance.

Titles: plotly's toolbar (zoom, pan, save) and dropdowns sit at the top of a figure. `place_title`
puts the title below the toolbar's strip, with an optional smaller second line, and makes room for it.
"""

from __future__ import annotations

import math
import re
import textwrap
import zlib

COMPUTE = {
    "forward": "#56B4E9",  # sky blue
    "backward": "#332288",  # indigo: the same work, backwards, darker
    "optimizer": "#228833",  # green
    "experts": "#BBCC33",  # pear: an MoE layer's experts
    "wait": "#CCCCCC",  # light grey: blocked on a collective
    "emulated": "#777777",  # grey: held back by the emulated link (toolkit.comm.emulate)
    "other": "#EE8866",  # orange: any other compute span
}
COMMUNICATION = {
    "all_reduce": "#882255",  # wine
    "reduce_scatter": "#DDCC77",  # sand
    "all_gather": "#44BB99",  # mint
    "all_to_all": "#AA4499",  # purple
    "broadcast": "#99DDFF",  # pale blue
    "send": "#EE7733",  # orange
    "recv": "#994F00",  # brown
    "barrier": "#000000",
}
MEMORY = {
    "params": "#4477AA",
    "grads": "#CC6677",
    "optimizer": COMPUTE["optimizer"],
    "activations": "#DDCC77",
    "states": "#88CCEE",
    "total": "#222222",
    # a simulated rank's other categories at its peak (toolkit.sim.memory): a unit's gathered parameters
    # (dark blue, kin to params), buffers handed to collectives, temporaries of backward and the step
    "gathered": "#004488",
    "comm": "#BBCC33",
    "temporary": "#BBBBBB",
}
IMPLEMENTATIONS = {"backend": "#4477AA", "ring": "#EE6677", "custom": "#228833"}  # who ran a collective
SEQUENCE = ("#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB", "#332288")  # numbered things
LOAD_SCALE = ("#2166AC", "#92C5DE", "#F7F7F7", "#F4A582", "#B2182B")  # idle .. balanced (white) .. hot: blue-red
THEORY = "#000000"  # a formula's prediction or a reference level (diamonds, dashed lines)
MARK = "#000000"  # a point singled out on a figure (the busiest expert)
SEPARATOR = "#FFFFFF"  # the thin line between two spans of one colour
ALERT = "#CC3311"  # a limit crossed, tokens dropped, memory freed
LABELS = {"emulated": "wait (emulated link)"}  # a category's name on the legend, where it is not its key
BLOCKED = "wait in "  # "wait in all_reduce": a synchronous collective that kept a compute span waiting (grey,
# as every wait: one colour, one word)
HANDWRITTEN_PATTERN = "/"  # a collective run by a hand-written implementation (ring, pairwise) is hatched

# Machado, Oliveira and Fernandes (2009), severity 1: linear-RGB matrices that show a colour as a reader
# with that colour-vision deficiency sees it (the same as an SVG feColorMatrix in linearRGB).
CVD_MATRICES = {
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413), (-0.011820, 0.042940, 0.968881)),
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216), (-0.003882, -0.048116, 1.051998)),
}


def compute_category(event) -> str:
    """The compute-lane category of a span: forward, backward, optimizer, experts, wait, emulated or other."""
    name = str(event["name"])
    if event.get("cat") == "wait" or name == "wait":
        return "emulated" if event.get("args", {}).get("emulated") else "wait"
    word = name.split(" ")[0]
    if word in ("forward", "backward", "optimizer"):
        return word
    if name.startswith("moe/") and name.endswith("experts"):
        return "experts"
    return "other"


def operation_of(name: str) -> str:
    """The collective a communication span's name starts with ("all_to_all · dispatch" -> "all_to_all")."""
    return str(name).split(" ")[0]


def comm_colour(name: str) -> str:
    """The colour of a communication span's name: its operation's, in the shade its refinement gets."""
    operation = operation_of(name)
    return shade(COMMUNICATION.get(operation, COMPUTE["other"]), variant(name, operation))


def compute_colour(label: str) -> str:
    """The colour of a compute-lane name ("forward", "backward blocks.1", "wait (emulated link)", ...)."""
    category = compute_category({"name": label, "cat": "compute", "args": {}})
    if label == LABELS["emulated"]:
        category = "emulated"
    elif label.startswith(BLOCKED):  # a synchronous collective inside compute: waiting
        category = "wait"
    return shade(COMPUTE[category], variant(label, category))


def variant(name: str, category: str) -> int:
    """Which shade of its category's colour a name gets, the same in every figure: 0 (the colour itself) for
    the category's own name, 1 for a root unit, 2 + i for unit i ("blocks.3": 5), 2 for a pass's units drawn
    together ("forward · units"), else one by the name."""
    name = str(name)
    if name in (category, LABELS.get(category)):
        return 0
    if name.endswith("(root)"):
        return 1
    if name.endswith(" · units"):  # every unit of a pass in one shade, darker (the timeline names each bar)
        return 2
    number = re.search(r"(\d+)$", name)
    return 2 + int(number.group(1)) if number else 1 + zlib.crc32(name.encode()) % 6


def shade(colour: str, k: int) -> str:
    """The k-th shade of a colour (k = 0: itself; then lighter and darker in turn, six in all), for names
    that refine one category."""
    if k == 0:
        return colour
    k = 1 + (k - 1) % 6
    toward, amount = (255, 0.28 * ((k + 1) // 2)) if k % 2 else (0, 0.22 * (k // 2))
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (toward - c) * amount):02X}" for c in rgb)


# --- log axes --------------------------------------------------------------------------------------------
def log_ticks(low: float, high: float, most: int = 6) -> list[float]:
    """At most `most` round values (1-2-5, then 1-3, then powers of ten, then every other one) from `low` to
    `high`: plotly's own log ticks label 2, 3, ... 9 in every decade, crowded on a narrow panel."""
    if not (0 < low <= high):
        return []
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    for mantissas in ((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 5), (1, 3), (1,)):
        values = [
            m * 10.0**e
            for e in decades
            for m in mantissas
            if low <= m * 10.0**e * (1 + 1e-9) and m * 10.0**e <= high * (1 + 1e-9)
        ]
        if len(values) <= most and (len(values) >= 2 or mantissas != (1, 2, 3, 4, 5, 6, 7, 8, 9)):
            return values
    return values[:: math.ceil(len(values) / most)]


def readable_log_axes(fig, text: dict, most: int = 6):
    """Give every log axis of `fig` (every subplot's) `log_ticks` over the data it shows, labelled by
    `text["x"]` / `text["y"]` (a value -> its label, e.g. `units.bytes_text`)."""
    spans: dict[str, list[float]] = {}
    for trace in fig.data:
        for letter in ("x", "y"):
            shown = getattr(trace, letter)
            values = [] if shown is None else [v for v in shown if isinstance(v, (int, float)) and v > 0]
            error = getattr(trace, f"error_{letter}", None)
            if error is not None and error.array is not None and values:
                values += [v + e for v, e in zip(values, error.array)]
                values += [v - e for v, e in zip(values, error.arrayminus or error.array) if v - e > 0]
            name = letter + "axis" + (getattr(trace, f"{letter}axis") or letter)[1:]
            spans.setdefault(name, []).extend(values)
    for name, values in spans.items():
        axis = fig.layout[name]
        ticks = log_ticks(min(values), max(values), most) if axis.type == "log" and values else []
        if len(ticks) >= 2:  # else (one point, a narrow range) plotly's own ticks are few anyway
            axis.update(tickvals=ticks, ticktext=[text[name[0]](v) for v in ticks])
    return fig


# --- titles ----------------------------------------------------------------------------------------------
TOOLBAR_PX = 34  # plotly's toolbar strip at the top right; the title starts below it
TITLE_PX, SUBTITLE_PX = 24, 19  # height of one line of each
TITLE_CHARS, SUBTITLE_CHARS = 80, 110  # longer lines wrap: about 720 pixels at plotly's title sizes


def _wrap(text: str, width: int) -> tuple[str, int]:
    """The text with long lines broken at spaces ("<br>"), and how many lines it has."""
    if not text:
        return "", 0
    lines = [part for line in text.split("<br>") for part in (textwrap.wrap(line, width) or [""])]
    return "<br>".join(lines), len(lines)


def place_title(fig, title: str, subtitle: str | None = None, *, above_plot_px: int = 16):
    """Title (and a smaller second line) in the top margin, below the toolbar strip, long lines wrapped,
    the margin grown to fit; `above_plot_px`: room kept between the title and the plot (a legend or
    dropdown row goes there)."""
    title, title_lines = _wrap(title, TITLE_CHARS)
    subtitle, subtitle_lines = _wrap(subtitle or "", SUBTITLE_CHARS)
    top = TOOLBAR_PX + TITLE_PX * title_lines + SUBTITLE_PX * subtitle_lines + above_plot_px
    fig.update_layout(
        title=dict(
            text=title,
            x=0,
            xref="paper",
            xanchor="left",
            y=1,
            yref="container",
            yanchor="top",
            pad=dict(t=TOOLBAR_PX),
            subtitle=dict(text=subtitle, font=dict(size=13, color="#555555")),
        ),
        margin=dict(t=top),
    )
    return fig
