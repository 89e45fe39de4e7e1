"""What a student sees, in a real browser: the demo's report opened from a file with no network, and the
lessons run in JupyterLab with their widgets used by hand (Chromium, driven by Playwright; tests/browser.py).

`make test` runs a small set: the report built from one short real training of dp, fsdp and moe-ep (every
kind of figure, the wide table, the MoE dropdown), and lesson 03 in JupyterLab (its set-up cell, then the
memory explorer out of order; the K slider redraws it; saving leaves the lesson byte for byte as stored).
`make test-browser` (TOOLKIT_BROWSER_LESSONS=all) adds the full demo report and every lesson run top to
bottom, with lesson 01's "Launch and draw" button, lesson 03's slider and lesson 04's wrap-policy
explorer. Screenshots land in runs/browser/, one of them as a reader with deuteranopia sees the report.
"""

from __future__ import annotations

import os
import re

import pytest
from browser import (
    SHOTS,
    Lab,
    code_cell,
    errors_shown,
    launch_chromium,
    open_lesson,
    run_all,
    run_cell,
    save,
    sync_playwright,
)

from toolkit.viz import style

pytestmark = pytest.mark.browser
ALL = os.environ.get("TOOLKIT_BROWSER_LESSONS") == "all"
LESSONS = ["01-collectives", "02-data-parallel", "03-zero", "04-fsdp", "05-moe-expert-parallel", "06-moe-systems"]
REPORT_STRATEGIES = ("dp", "fsdp", "moe-ep")


@pytest.fixture(scope="module")
def chromium():
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium):
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.problems = []  # console errors and uncaught exceptions, as the page reports them
    page.on("console", lambda m: page.problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    context.route(re.compile(r"^https?://(?!127\.0\.0\.1)"), lambda route: route.abort())  # no network but ours
    yield page
    context.close()


# --- the report --------------------------------------------------------------------------------------------
def _measure_and_train(names, steps):
    """On each rank: one size of every collective, both ways, then a few steps of each strategy."""
    import torch.distributed as dist

    from toolkit import compare
    from toolkit.comm import measure
    from toolkit.comm.collectives import OPERATIONS
    from toolkit.run import Run
    from toolkit.trace import recorder
    from toolkit.train import train

    recorder.reset()
    records = measure.time_collectives(OPERATIONS, (64 * 1024,), measure.IMPLEMENTATIONS, warmup=1, repeats=1)
    runs = {"collectives": Run.capture({"demo": "collectives"})}
    for name in names:
        config, model_fn, _ = compare.plan(name, dist.get_world_size(), steps)
        runs[name] = train(config, model_fn=model_fn)
    return records, runs


def small_report(out) -> str:
    """The demo's report from one short launch (every collective at one size, then dp, fsdp and moe-ep on 2
    ranks for 2 steps): the same code as `make demo` draws it, less waiting."""
    import toolkit
    from toolkit import compare, demo, interpret
    from toolkit.run import Run

    per_rank = toolkit.launch(_measure_and_train, 2, args=(REPORT_STRATEGIES, 2), timeout_s=180)
    records = per_rank[0][0]
    runs = {name: Run.merge(r[1][name] for r in per_rank) for name in ("collectives",) + REPORT_STRATEGIES}
    collectives = runs.pop("collectives")
    rows, predicted, moe = [], {}, None
    for name, run in runs.items():
        row, predicted[name], theory = compare.measure(name, run, 2)
        rows.append(row)
        moe = theory or moe
    explained = interpret.notes(rows, runs, moe=moe)
    blocks = demo.collectives_blocks(records, collectives, 2) + compare.training_blocks(
        runs, rows, predicted, world_size=2, steps=2, moe=moe, explained=explained
    )
    paths = {
        kind: str(out / f"demo-{kind}.{ext}") for kind, ext in (("report", "html"), ("trace", "json"), ("run", "json"))
    }
    return demo.write_demo_report(paths, collectives, blocks, list(runs), out, seconds=0.0)


def _overlap(a, b) -> bool:
    return bool(
        a
        and b
        and a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


def check_report(page, path, name: str) -> None:
    """Every figure draws, no error, nothing wider than the page, headings visible, titles clear of the
    toolbar and dropdowns, one colour per meaning; screenshots, one through deuteranopia's eyes."""
    page.goto(f"file://{path}")
    figures = page.locator(".figure").count()
    page.wait_for_function(f"() => document.querySelectorAll('.figure .main-svg').length >= {figures}", timeout=60_000)
    assert figures >= 10 and not page.problems, page.problems
    assert not re.search(r"<script[^>]*src=[\"']?https?:", open(path, encoding="utf-8").read())
    for width in (1280, 900):
        page.set_viewport_size({"width": width, "height": 900})
        try:  # plotly redraws responsive figures a moment after the window changes
            page.wait_for_function(
                "() => document.documentElement.scrollWidth <= document.documentElement.clientWidth", timeout=15_000
            )
        except Exception:  # noqa: BLE001 - say what sticks out
            wide = page.evaluate("""() => [...document.body.querySelectorAll('*')].filter(e =>
                e.getBoundingClientRect().right > document.documentElement.clientWidth + 1).slice(0, 5)
                .map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right))""")
            raise AssertionError(f"at {width} px something is wider than the page: {wide}") from None
        for heading in page.locator("h1, h2").all():
            box = heading.bounding_box()
            assert heading.is_visible() and box["width"] > 0 and box["x"] + box["width"] <= width, heading.inner_text()
    for i in range(figures):  # at 900 px, where long titles would run into the toolbar first
        figure = page.locator(".figure .js-plotly-plot").nth(i)
        figure.scroll_into_view_if_needed()
        figure.hover(position={"x": 20, "y": 80})  # the toolbar shows on hover
        title, plot = figure.locator(".gtitle").bounding_box(), figure.bounding_box()
        for other in (".modebar", ".updatemenu-container", ".gtitle-subtitle"):
            for clash in figure.locator(other).all():
                assert not _overlap(title, clash.bounding_box()), f"figure {i}: the title runs under {other}"
        assert title is None or title["x"] + title["width"] <= plot["x"] + plot["width"] + 1, f"figure {i}'s title"
    colours = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(gd =>
        gd.data.filter(t => t.type === 'bar' && t.orientation === 'h').map(t => [t.name, t.marker.color]))""")
    seen = {}
    for trace, colour in colours:
        seen.setdefault(trace, set()).add(colour)
    assert {n: c for n, c in seen.items() if len(c) > 1} == {}, "a timeline name changes colour between figures"
    palette = dict(style.COMPUTE, **style.COMMUNICATION)
    for trace, colour in seen.items():
        if trace in palette:
            assert colour == {palette[trace]}, (trace, colour)
    assert {"forward", "backward", "optimizer", "all_reduce", "all_gather", "reduce_scatter"} <= set(seen)
    greys = {style.shade(style.COMPUTE["wait"], k) for k in range(7)}  # a grey says "wait", in every figure
    assert all(name.startswith("wait") for name, used in seen.items() if used & greys), seen
    check_numbers_read(page)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1280, "height": 900})
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    matrix = " ".join(" ".join(map(str, row)) + " 0 0" for row in style.CVD_MATRICES["deuteranopia"]) + " 0 0 0 1 0"
    page.evaluate(
        """m => { const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
        svg.setAttribute('style', 'position:absolute;width:0;height:0');
        svg.innerHTML = `<filter id="cvd" color-interpolation-filters="linearRGB">
                         <feColorMatrix type="matrix" values="${m}"/></filter>`;
        document.body.appendChild(svg); document.body.style.filter = 'url(#cvd)'; }""",
        matrix,
    )
    page.screenshot(path=str(SHOTS / f"{name}-deuteranopia.png"), full_page=True)


def check_numbers_read(page) -> None:
    """What the trial found hard to read, each checked where it was: no "0.000 GB/s" cell (a small message's
    rate in kB/s), at most six labels on a log axis (plotly's own put 2 ... 9 in every decade), the bytes chart
    in the table's unit, and every label inside a bar within its bar (not clipped)."""
    text = page.inner_text("body")
    assert not re.search(r"(?<![\d.])0\.0\d* [kMGT]?B/s", text), re.findall(r".{40}0\.0\d* [kMGT]?B/s", text)[:3]
    axes = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(gd =>
        [...gd.querySelectorAll('.cartesianlayer .subplot')].flatMap(sp => {
            const id = [...sp.classList].find(c => /^x\\d*y\\d*$/.test(c));
            return id.match(/[xy]\\d*/g).map(a => {
                const axis = gd._fullLayout[a[0] + 'axis' + a.slice(1)];
                const ticks = gd.querySelectorAll(`.${a[0]}axislayer-above .${a[0]}tick`);
                return [gd.querySelector('.gtitle') && gd.querySelector('.gtitle').textContent, a,
                        axis && axis.type, [...ticks].filter(t => t.getAttribute('transform')).length]; }); }))""")
    crowded = [a for a in axes if a[2] == "log" and a[3] > 6]
    assert any(a[2] == "log" for a in axes) and not crowded, crowded
    units = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(gd =>
        (gd.layout.title.text || '').startsWith('Bytes each rank sends')).map(gd => gd.layout.yaxis.title.text)""")
    headers = page.eval_on_selector_all("th", "els => els.map(e => e.innerText)")
    assert units and all(u.split()[0] in " ".join(headers) for u in units), (units, headers)
    clipped = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot .barlayer .point')].flatMap(p => {
        const label = p.querySelector('text'), bar = p.querySelector('path');
        if (!label || !bar || !label.textContent) return [];
        const t = label.getBoundingClientRect(), b = bar.getBoundingClientRect();
        if (t.width === 0 || getComputedStyle(label).opacity === '0') return [];
        return (t.left < b.left - 1 || t.right > b.right + 1 || t.top < b.top - 2 || t.bottom > b.bottom + 2)
            ? [label.textContent] : []; })""")
    assert not clipped, f"bar labels wider than their bars: {clipped[:5]}"


@pytest.mark.timeout(300)
def test_the_report_reads_offline_in_chromium(page, tmp_path, no_leftover_ranks):
    check_report(page, small_report(tmp_path), "report")


@pytest.mark.skipif(not ALL, reason="the full demo report: make test-browser")
@pytest.mark.timeout(900)
def test_the_full_demo_report(page, tmp_path, no_leftover_ranks):
    from toolkit import demo

    paths = demo.run_demo(
        world_size=4, out_dir=str(tmp_path), sizes=(4096, 1 << 20), repeats=2, train_steps=2, say=lambda *_: None
    )
    check_report(page, paths["report"], "demo-report")


# --- the lessons in JupyterLab ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("lab"))
    yield server
    left = server.close()
    assert not left, f"processes left running after JupyterLab shut down: {left}"


def test_make_lab_starts_jupyterlab_as_root_too():
    """JupyterLab refuses to run as root without --allow-root: `make lab` adds it when root runs it."""
    import subprocess

    from browser import ROOT

    dry = subprocess.run(
        ["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    (command,) = [line for line in dry if "jupyter lab" in line]
    assert ("--allow-root" in command) == (os.geteuid() == 0), command


def assert_saved_as_stored(lab, lesson: str) -> None:
    """Saving a lesson that ran writes back exactly the files the repository stores (`git status` stays clean)."""
    from browser import ROOT

    for suffix in (".ipynb", ".py"):
        saved = (lab.folder / "notebooks" / (lesson + suffix)).read_bytes()
        assert saved == (ROOT / "notebooks" / (lesson + suffix)).read_bytes(), (
            f"saving {lesson} in JupyterLab changed its {suffix}: outputs or header fields were written"
        )


def explore_memory(page) -> None:
    """Lesson 03: typing K = 16 into the memory explorer's slider redraws the bars and the totals."""
    output = page.locator(".widget-output").last
    before = output.inner_text()
    assert "K = 12" in before
    readout = page.locator(".widget-slider", has=page.locator(".widget-label", has_text="K bytes/param")).locator(
        ".widget-readout"
    )
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type("16")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "b => { const o = document.querySelectorAll('.widget-output'); return o[o.length - 1].innerText !== b; }",
        arg=before,
        timeout=30_000,
    )
    assert "K = 16" in output.inner_text() and output.locator(".js-plotly-plot .main-svg").count() >= 1
    assert "K = 16" in output.locator(".gtitle-subtitle").text_content()


def launch_and_draw(page) -> None:
    """Lesson 01: the panel's button launches ranks and draws a new timeline under it."""
    panel = page.locator(".widget-vbox", has=page.get_by_role("button", name="Launch and draw")).last
    assert panel.locator(".js-plotly-plot").count() == 0
    panel.locator(".widget-dropdown select").nth(1).select_option("backend")  # quicker than both
    panel.get_by_role("button", name="Launch and draw").click()
    page.wait_for_function(
        "() => [...document.querySelectorAll('.widget-html')].some(e => e.innerText.startsWith('done'))",
        timeout=180_000,
    )
    figure = panel.locator(".js-plotly-plot")
    assert figure.count() == 1 and "ranks" in figure.locator(".gtitle").text_content()


def explore_wrap_policy(page) -> None:
    """Lesson 04: choosing another wrap policy redraws the units and the predicted peak."""
    output = page.locator(".widget-output").last
    before = output.inner_text()
    policy = page.locator(".widget-dropdown", has=page.locator("label", has_text="wrap policy")).locator("select")
    policy.select_option("each Linear layer")
    page.wait_for_function(
        "b => { const o = document.querySelectorAll('.widget-output'); return o[o.length - 1].innerText !== b; }",
        arg=before,
        timeout=30_000,
    )
    assert "each Linear layer" in output.locator(".gtitle").text_content()


def explore_scale(page) -> None:
    """Lesson 07: three configurations, three clicks of "simulate": each redraws the figure in the panel (its
    title names the configuration, its dashed line the GPU's memory) and the verdict under it. (The trial: the
    old panel printed a new summary on each click above a figure that never changed.)"""
    panel = page.locator(".toolkit-scale-explorer").last
    output = panel.locator(".widget-output")

    def choose(label, value):
        panel.locator(".widget-dropdown", has=page.locator("label", has_text=label)).locator("select").select_option(
            value
        )

    seen = []
    for model, strategy, gpus, cluster in (
        ("GPT-2 XL", "zero3", "8", "dgx-a100"),
        ("GPT-3 175B", "ddp", "64", "dgx-a100"),
        ("GPT-2 XL", "hsdp", "64", "dgx-h100"),
    ):
        before = output.inner_text()
        choose("model", model)
        choose("strategy", strategy)
        choose("GPUs", gpus)
        choose("cluster", cluster)
        panel.get_by_role("button", name="simulate").click()
        page.wait_for_function(
            "([b, w]) => { const o = [...document.querySelectorAll('.widget-output')].pop(); "
            "return o.innerText !== b && o.innerText.includes(w); }",
            arg=[before, f"rank 0 of {gpus} on {cluster}"],
            timeout=240_000,
        )
        title = output.locator(".js-plotly-plot .gtitle").text_content()
        verdict = output.inner_text()
        assert output.locator(".js-plotly-plot").count() == 1
        fits = "fits in the" in verdict
        assert f"{model}, {strategy}, rank 0 of {gpus}" in title and fits != ("DOES NOT FIT" in verdict)
        assert (": fits" in title) == fits == ("TFLOP/s" in verdict) and ("does not fit" in title) != fits
        assert output.locator(".js-plotly-plot .shapelayer path").count() >= 1  # the GPU's memory, dashed
        seen.append((title, verdict))
    assert len(set(seen)) == 3 and "H100" in seen[-1][1]
    assert "DOES NOT FIT" in seen[1][1] and "shard the model states" in seen[1][1]  # GPT-3 under ddp, and what would


INTERACTIONS = {
    "01-collectives": launch_and_draw,
    "03-zero": explore_memory,
    "04-fsdp": explore_wrap_policy,
    "07-at-scale": explore_scale,
}


@pytest.mark.skipif(not ALL, reason="a second lesson's widget in JupyterLab (19 CPU s): make test-browser")
@pytest.mark.timeout(300)
def test_lesson_03_explorer_in_jupyterlab(page, lab):
    """The set-up cell, then the memory explorer out of order; its slider; then save. (`make test` clicks
    lesson 07's explorer in JupyterLab; `make test-browser` this one too, and every lesson top to bottom.)"""
    open_lesson(page, lab, "03-zero.ipynb")
    run_cell(page, page.locator(".jp-Notebook .jp-CodeCell").first)
    run_cell(page, code_cell(page, "memory_explorer("))
    assert not errors_shown(page) and not page.problems, (errors_shown(page), page.problems)
    explore_memory(page)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "lesson-03-explorer.png"))
    save(page)
    page.close()  # first the page, then its kernel: a page that sees its kernel go asks for a new one
    lab.stop_kernels()
    assert_saved_as_stored(lab, "03-zero")


@pytest.mark.timeout(900)
def test_lesson_07_scale_explorer_in_jupyterlab(page, lab):
    """The set-up cell, then the scale explorer out of order; three configurations clicked through; then save."""
    open_lesson(page, lab, "07-at-scale.ipynb")
    run_cell(page, page.locator(".jp-Notebook .jp-CodeCell").first)
    run_cell(page, code_cell(page, "scale_explorer("), timeout_s=300)
    assert not errors_shown(page) and not page.problems, (errors_shown(page), page.problems)
    assert "fits in the" in page.locator(".widget-output").last.inner_text()  # drawn before anything is touched
    explore_scale(page)
    assert not errors_shown(page) and not page.problems, (errors_shown(page), page.problems)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "lesson-07-explorer.png"))
    save(page)
    page.close()
    lab.stop_kernels()
    assert_saved_as_stored(lab, "07-at-scale")


@pytest.mark.skipif(not ALL, reason="every lesson, top to bottom: make test-browser")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_runs_in_jupyterlab(page, lab, lesson):
    open_lesson(page, lab, f"{lesson}.ipynb")
    seconds = run_all(page, timeout_s=600)
    problems = errors_shown(page)
    assert not problems, f"{lesson} after {seconds:.0f} s:\n" + "\n".join(problems)
    if lesson in INTERACTIONS:
        INTERACTIONS[lesson](page)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"lesson-{lesson}.png"))  # the widget just used, or the lesson's end
    save(page)
    page.close()  # first the page, then its kernel: a page that sees its kernel go asks for a new one
    lab.stop_kernels()
    assert_saved_as_stored(lab, lesson)
