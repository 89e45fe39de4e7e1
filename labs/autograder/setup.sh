#!/usr/bin/env bash
# Gradescope runs this once, when the autograder image is built (Ubuntu, as root). CPU only: torch's CPU
# build, gloo for the collectives. The toolkit's source is in /autograder/source (the zip's content).
# Only what grading needs: pyproject's `grading` extra (torch, cloudpickle, numpy, tqdm), no JupyterLab,
# ipyparallel or MPI. The toolkit itself is not installed: the grader runs it from /autograder/source, which
# run_autograder makes root's alone, and the submission's ranks import the students' build of it (the lab's
# answers taken out), built here once and kept in the image.
set -euo pipefail
apt-get update -q && apt-get install -y -q python3 python3-pip python3-venv
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
GRADING=$(/autograder/venv/bin/python - /autograder/source/pyproject.toml <<'PY'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"^grading = \[(.*?)\]", text, re.S | re.M).group(1)
print(" ".join(re.findall(r'"([^"]+)"', block)))
PY
)
/autograder/venv/bin/pip install -q $GRADING
ln -sf /autograder/venv/bin/python3 /usr/local/bin/python3
cd /autograder/source && /autograder/venv/bin/python -m toolkit grade "labs/$(cat LAB)" --prepare
