"""What the benches share on the parent's side: putting a table into docs/benchmarks.md, and the simulator's
preset for the GPU a GPU bench runs on.

(The helpers a rank runs, such as the slowest rank's time, stay in each bench: ``toolkit.launch`` ships
a rank's function by value, and a module imported from bench/ is not importable on the ranks.)
"""

from __future__ import annotations

import os
import time


def write_section(path: str, title: str, command: str, body: str) -> None:
    """Put the section ``title`` (a "## " heading) into ``path``: replace an earlier one, keep every
    other section, a blank line before the next heading."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    section = f"{title}\n\n`{command}` ({time.strftime('%Y-%m-%d')})\n\n{body}\n"
    start = text.find(title)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(title))
        text = text[:start] + section + ("\n" + text[end + 1 :] if end >= 0 else "")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def append_table(path: str, command: str, text: str) -> None:
    """Add a run's table at the end of ``path``, under a "### " heading naming the command and the date."""
    with open(path, "a") as f:
        f.write(f"\n### `{command}` ({time.strftime('%Y-%m-%d')})\n\n{text}\n")


# The simulator's cluster for each GPU `torch.cuda.get_device_name()` may name (the first key the name contains).
GPU_PRESETS = {"H200": "dgx-h100 with H200 memory", "H100": "dgx-h100", "A100": "dgx-a100"}


def cluster_for(device_name: str):
    """(the preset's name, the cluster `toolkit.sim.simulate` takes) for this GPU, or (None, None) where the simulator
    has no preset for it."""
    name = next((p for key, p in GPU_PRESETS.items() if key in device_name), None)
    if name is None:
        return None, None
    return name, (_h200() if name == GPU_PRESETS["H200"] else name)


def _h200():
    """No H200 preset in the simulator: an H100 SXM's compute (the same Hopper die and clocks) with the H200's
    memory, 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200 datasheet), in a DGX H100's links."""
    import dataclasses

    from toolkit.sim.hardware import GPUS, cluster_of

    gpu = dataclasses.replace(
        GPUS["h100-sxm"],
        name="H200 SXM 141GB",
        memory_bytes=141e9,
        memory_bandwidth=4.8e12,
        source=GPUS["h100-sxm"].source + "; memory: NVIDIA H200 datasheet",
    )
    return cluster_of("dgx-h100", gpu=gpu)
