"""A report as one self-contained HTML file: title, text, tables and interactive plotly figures.

Why self-contained: a report is mailed, attached to an assignment, opened on a cluster login node or
a laptop on a plane. plotly.js is inlined once (a few MB) and every figure after the first reuses it,
so the file opens anywhere with no network and no Python.

Blocks are written in order: a `str` is a paragraph, `heading(...)`, `preformatted(...)`, `note(...)` and
`bullets(...)` mark other kinds of text, a list of dicts is a table (columns from the first row), and a plotly
figure is a figure.
"""

from __future__ import annotations

import datetime
import html
import os

import plotly.io as pio

STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
.subtitle { color: #666; margin-top: 0; }
.table { max-width: 100%; overflow-x: auto; margin: 1em 0; }  /* a wide table scrolls, the page does not */
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.5em; text-align: left; }
td { white-space: nowrap; } th { vertical-align: bottom; }  /* headers wrap, numbers do not */
th { background: #f4f4f4; } tr:nth-child(even) td { background: #fafafa; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.note { background: #fff8e1; border-left: 4px solid #f0c36d; padding: 0.5em 0.8em; }
.figure { margin: 1em 0; max-width: 100%; }
li { margin: 0.3em 0; }
"""


class Html(str):
    """Text that is already HTML (made by the helpers below); anything else is escaped."""


def heading(text: str) -> Html:
    return Html(f"<h2>{html.escape(text)}</h2>")


def preformatted(text: str) -> Html:
    return Html(f"<pre>{html.escape(text)}</pre>")


def note(text: str) -> Html:
    return Html(f'<p class="note">{html.escape(text)}</p>')


def bullets(lines) -> Html:
    """A bulleted list of sentences (nothing when there are none)."""
    items = "".join(f"<li>{html.escape(str(line))}</li>" for line in lines)
    return Html(f"<ul>{items}</ul>" if items else "")


def table(rows) -> Html:
    """An HTML table from a list of dicts (the first row's keys are the columns)."""
    rows = list(rows)
    if not rows:
        return Html("<p><em>(empty table)</em></p>")
    columns = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(row.get(c, '')))}</td>" for c in columns) + "</tr>" for row in rows
    )
    return Html(f'<div class="table"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>')


def _is_figure(block) -> bool:
    return hasattr(block, "to_plotly_json")


def _render(block, plotly_js_written: bool) -> tuple[str, bool]:
    if _is_figure(block):
        div = pio.to_html(
            block,
            include_plotlyjs=not plotly_js_written,
            full_html=False,
            config={"displaylogo": False, "responsive": True},
        )
        return f'<div class="figure">{div}</div>', True
    if isinstance(block, Html):
        return str(block), plotly_js_written
    if isinstance(block, str):
        return f"<p>{html.escape(block)}</p>", plotly_js_written
    if isinstance(block, (list, tuple)) and all(isinstance(row, dict) for row in block):
        return table(block), plotly_js_written
    raise TypeError(
        f"a report block must be text, a table (list of dicts) or a plotly figure, not {type(block).__name__}."
    )


def report_html(title: str, blocks, *, subtitle: str | None = None) -> str:
    """The whole HTML document as a string (plotly.js inlined before the first figure)."""
    written, parts = False, []
    for block in blocks:
        rendered, written = _render(block, written)
        parts.append(rendered)
    stamp = subtitle or f"written {datetime.datetime.now():%Y-%m-%d %H:%M}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f'<p class="subtitle">{html.escape(stamp)}</p>\n' + "\n".join(parts) + "\n</body></html>\n"
    )


def write_report(path, title: str, blocks, *, subtitle: str | None = None) -> str:
    """Write the report to `path` (folders are created); return the path."""
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(report_html(title, blocks, subtitle=subtitle))
    return os.fspath(path)
