"""Who sends which chunk at each step of a ring all-reduce: the schedule of `toolkit.comm.ring`, drawn.

The tensor is cut into N chunks. In the reduce-scatter half, at step s rank r sends chunk (r-s-1) mod N
to its right neighbour and adds the chunk (r-s-2) mod N that arrives from its left; after N-1 steps
rank r owns chunk r fully reduced. In the all-gather half, at step s rank r forwards chunk (r-s) mod N,
and after N-1 more steps everyone has every reduced chunk. Every step every link carries one chunk,
1/N of the tensor, so each rank sends 2(N-1)/N of it in total.
"""

from __future__ import annotations

import plotly.graph_objects as go

from . import style

CHUNK_COLOURS = style.SEQUENCE


def ring_steps(n: int) -> list[dict]:
    """Every message of a ring all-reduce on n ranks: half, step (1-based), rank, chunk, to, from, received chunk."""
    if n < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got n={n}.")
    steps = []
    for s in range(n - 1):
        for r in range(n):
            steps.append(
                {
                    "half": "reduce-scatter",
                    "step": s + 1,
                    "rank": r,
                    "chunk": (r - s - 1) % n,
                    "to": (r + 1) % n,
                    "from": (r - 1) % n,
                    "received": (r - s - 2) % n,
                }
            )
    for s in range(n - 1):
        for r in range(n):
            steps.append(
                {
                    "half": "all-gather",
                    "step": s + 1,
                    "rank": r,
                    "chunk": (r - s) % n,
                    "to": (r + 1) % n,
                    "from": (r - 1) % n,
                    "received": (r - s - 1) % n,
                }
            )
    return steps


def _colourscale(n: int):
    """A stepwise scale so chunk i always gets colour i."""
    scale = []
    for i in range(n):
        colour = CHUNK_COLOURS[i % len(CHUNK_COLOURS)]
        scale += [(i / n, colour), ((i + 1) / n, colour)]
    return scale


def ring_schedule(n: int = 4) -> go.Figure:
    """A grid, ranks by steps: the cell says which chunk the rank sends, and to whom, at that step."""
    steps = ring_steps(n)
    columns = [f"RS {s}" for s in range(1, n)] + [f"AG {s}" for s in range(1, n)]
    z = [[None] * len(columns) for _ in range(n)]
    text = [[""] * len(columns) for _ in range(n)]
    hover = [[""] * len(columns) for _ in range(n)]
    for m in steps:
        col = m["step"] - 1 + (0 if m["half"] == "reduce-scatter" else n - 1)
        z[m["rank"]][col] = m["chunk"]
        text[m["rank"]][col] = f"c{m['chunk']} → r{m['to']}"
        action = "adds it to its own copy" if m["half"] == "reduce-scatter" else "keeps it"
        hover[m["rank"]][col] = (
            f"{m['half']} step {m['step']}: rank {m['rank']} sends chunk {m['chunk']} to rank "
            f"{m['to']}<br>and receives chunk {m['received']} from rank {m['from']}, then {action}"
        )
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=columns,
            y=[f"rank {r}" for r in range(n)],
            text=text,
            texttemplate="%{text}",
            hovertext=hover,
            hoverinfo="text",
            colorscale=_colourscale(n),
            zmin=-0.5,
            zmax=n - 0.5,
            xgap=3,
            ygap=3,
            colorbar=dict(title="chunk", tickvals=list(range(n)), ticktext=[f"c{i}" for i in range(n)]),
        )
    )
    style.place_title(
        fig,
        f"Ring all-reduce on {n} ranks: who sends which chunk, step by step",
        f"{n - 1} reduce-scatter steps (RS), then {n - 1} all-gather steps (AG); each rank sends "
        f"2(N-1)/N = {2 * (n - 1)}/{n} of the tensor",
    )
    fig.update_layout(
        yaxis=dict(autorange="reversed"), template="plotly_white", height=130 + 60 * n, margin=dict(l=10, r=10, b=30)
    )
    return fig
