#!/usr/bin/env bash
# Gradescope runs this once, when the autograder image is built (Ubuntu, as root). CPU only: torch's CPU
# build, gloo for the collectives. The toolkit's source is in /autograder/source (the zip's content).
# Only what grading needs: the toolkit without its dependencies, then pyproject's `grading` extra (torch,
# cloudpickle, numpy, tqdm): no JupyterLab, ipyparallel or MPI in the image.
set -euo pipefail
apt-get update -q && apt-get install -y -q python3 python3-pip python3-venv
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
/autograder/venv/bin/pip install -q --no-deps /autograder/source
GRADING=$(/autograder/venv/bin/python - /autograder/source/pyproject.toml <<'PY'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"^grading = \[(.*?)\]", text, re.S | re.M).group(1)
print(" ".join(re.findall(r'"([^"]+)"', block)))
PY
)
/autograder/venv/bin/pip install -q $GRADING
ln -sf /autograder/venv/bin/python3 /usr/local/bin/python3
