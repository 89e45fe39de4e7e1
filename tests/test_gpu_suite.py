"""`make test-gpu` on a machine without CUDA: it says it skipped, and why, and exits 0."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_make_test_gpu_runs_the_gpu_suite():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    target = re.search(r"^test-gpu:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert target and "bench/gpu_suite.py" in target.group(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make test-gpu runs the real suite")
@pytest.mark.timeout(60)
def test_without_cuda_the_gpu_suite_skips_with_its_reason_and_exits_0():
    done = subprocess.run([sys.executable, "bench/gpu_suite.py"], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout and "skipped" in done.stdout
    assert "--cpu-dry-run" in done.stdout  # and what to run instead
