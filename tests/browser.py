"""Driving a real browser for the tests: Debian's chromium through Playwright, and JupyterLab on a free port.

Playwright's own browser download is not used (it cannot be reached from the course machines); the
browser is the system's Chromium (`CHROMIUM=/path` to choose another). Where neither Playwright nor a
Chromium is there, the tests fail and say how to get them: they are never skipped silently.

`Lab` starts JupyterLab on a copy of the lessons (so saving one cannot touch the repository), with a
token, on a free port, with its own settings (every cell attached to the page, no news pop-up), and
at the end shuts down every kernel and the server, and checks that no process it started is left.
The helpers below it open a lesson, run cells, read what went wrong, and save.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "runs" / "browser"  # screenshots for people to look at
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SETTINGS = {  # JupyterLab settings for a test: every cell in the DOM, nothing fetched from the network
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


def chromium_path() -> str:
    """The Chromium to drive: $CHROMIUM, else chromium / chromium-browser / google-chrome on the PATH."""
    found = os.environ.get("CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )
    if not found:
        pytest.fail(
            "no Chromium to drive: `make setup` installs Debian's chromium when it runs as root with "
            "apt-get; otherwise install chromium (or Chrome) and/or set CHROMIUM=/path/to/it."
        )
    return found


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError:
        pytest.fail("Playwright for Python is missing: `make setup` installs it (pyproject's dev extra).")
    return start()


_PORT_TRIES = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries `marker` (the server, its kernels, their ranks)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(pid))
        except OSError:
            continue
    return found


class Lab:
    """JupyterLab serving a copy of notebooks/ (and jupytext.toml) from `folder`."""

    def __init__(self, folder: Path):
        self.folder, self.token = folder, secrets.token_hex(16)
        self.marker = f"TOOLKIT_BROWSER_LAB={self.token}"
        shutil.copytree(
            ROOT / "notebooks", folder / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__")
        )
        shutil.copy(ROOT / "jupytext.toml", folder / "jupytext.toml")
        for name, values in SETTINGS.items():
            path = folder / "settings" / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        for _ in range(_PORT_TRIES):
            self._start()
            if self._wait_until_up():
                return
        raise RuntimeError(f"JupyterLab found its port taken {_PORT_TRIES} times:\n{self.server_log()}")

    def _start(self) -> None:
        """The server on a port that was free a moment ago, its kernels on Unix sockets (no port to lose).

        A port found free can be taken before the server binds it (by any process binding port 0 meanwhile);
        the server then exits saying so, and `_wait_until_up` tells, so that the caller tries another port."""
        self.port = _free_port()
        env = dict(
            os.environ,
            JUPYTERLAB_SETTINGS_DIR=str(self.folder / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(self.folder / "workspaces"),
            TOOLKIT_BROWSER_LAB=self.token,
        )
        command = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={self.port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.folder}",
            "--ServerApp.port_retries=0",
            "--KernelManager.transport=ipc",
        ]
        if os.geteuid() == 0:
            command.append("--allow-root")  # what `make lab` adds as root
        self.log = open(self.folder / "server.log", "w")
        self.process = subprocess.Popen(
            command, cwd=self.folder, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def api(self, path: str, method: str = "GET"):
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def _wait_until_up(self, timeout_s: float = 90.0) -> bool:
        """True once the server answers; False when it exited because its port was taken."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.close()
                if "is already in use" in self.server_log():
                    return False
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}:\n{self.server_log()}")
            try:
                self.api("status")
                return True
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within {timeout_s:.0f} s:\n{self.server_log()}")

    def server_log(self) -> str:
        return (self.folder / "server.log").read_text()[-3000:]

    def url(self, notebook: str) -> str:
        """The lesson alone in a fresh workspace of its own (no tab restored from an earlier test)."""
        workspace = re.sub(r"\W", "-", notebook)
        return (
            f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/notebooks/{notebook}"
            f"?reset&token={self.token}"
        )

    def stop_kernels(self) -> None:
        for session in self.api("sessions"):
            self.api(f"sessions/{session['id']}", "DELETE")

    def close(self) -> list[int]:
        """Shut every kernel and the server down; return the PIDs still alive after that (should be none)."""
        try:
            self.stop_kernels()
            self.api("shutdown", "POST")
            self.process.wait(timeout=30)
        except Exception:  # noqa: BLE001 - whatever happened, do not leave the server behind
            os.killpg(self.process.pid, 15)
            self.process.wait(timeout=30)
        finally:
            self.log.close()
        deadline = time.monotonic() + 15
        while _ours(self.marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _ours(self.marker)
        for pid in left:  # report them, then end them so that nothing outlives the test run
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        return left


# --- a lesson in the page ------------------------------------------------------------------------------
def open_lesson(page, lab: Lab, notebook: str) -> None:
    """Open a lesson and wait for its kernel; it must open as stored: no dialog (a "Select Kernel" one), and the
    tab not marked modified before anything ran (toolkit_lessons.open_as_saved)."""
    page.goto(lab.url(notebook))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_function(
        "() => { const bar = document.querySelector('.jp-StatusBar-Left'); "
        "return bar && bar.innerText.includes('Idle'); }",
        timeout=120_000,
    )
    dialogs = page.locator(".jp-Dialog").all_inner_texts()
    assert not dialogs, f"JupyterLab opened {notebook} with a dialog: {dialogs}"
    page.wait_for_timeout(1000)  # the kernel's info has reached the notebook by now: the moment it marked it
    assert not page.locator(".jp-mod-current.jp-mod-dirty").count(), f"{notebook} is marked modified on opening"


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(
        ".jp-Notebook .jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.innerText.trim())"
    )


def code_cell(page, containing: str):
    """The code cell whose source contains `containing`."""
    return page.locator(
        ".jp-Notebook .jp-CodeCell", has=page.locator(".jp-InputArea-editor", has_text=containing)
    ).first


def run_cell(page, cell, timeout_s: float = 120) -> None:
    """Select a cell (command mode) and run it (Ctrl+Enter), then wait until its prompt has a number."""
    cell.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("Control+Enter")
    prompt = cell.locator(".jp-InputPrompt")
    deadline = time.monotonic() + timeout_s
    while not re.fullmatch(r"\[\d+\]:", prompt.inner_text().strip()):
        if time.monotonic() > deadline:
            raise AssertionError(f"a cell did not finish within {timeout_s:.0f} s: {cell.inner_text()[:300]}")
        time.sleep(0.3)


def run_all(page, timeout_s: float) -> float:
    """Run > Run All Cells; wait until every code cell has its execution count; return the seconds taken."""
    started = time.monotonic()
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    while True:
        prompts = _prompts(page)
        if prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return time.monotonic() - started
        if errors_shown(page) or time.monotonic() - started > timeout_s:  # an error stops the run
            raise AssertionError(
                f"Run All did not finish within {timeout_s:.0f} s (prompts {prompts});\n"
                + "\n".join(errors_shown(page))
            )
        time.sleep(1)


def errors_shown(page) -> list[str]:
    """Every traceback under a cell, and every widget that failed to display."""
    tracebacks = page.eval_on_selector_all(
        ".jp-OutputArea-output", "els => els.map(e => e.innerText).filter(t => t.includes('Traceback'))"
    )
    widgets = page.locator("text=Error displaying widget").count()
    return [t[-1500:] for t in tracebacks] + ([f"{widgets} x 'Error displaying widget'"] if widgets else [])


def save(page) -> None:
    """Ctrl+S, then wait until the tab no longer shows unsaved changes."""
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    page.wait_for_function("() => !document.querySelector('.jp-mod-current.jp-mod-dirty')", timeout=30_000)
    time.sleep(1)  # the paired .py is written just after the .ipynb
