#!/usr/bin/env bash
# Gradescope runs this once, when the autograder image is built (Ubuntu, as root). CPU only: torch's CPU
# build, gloo for the collectives. The toolkit's source is in /autograder/source (the zip's content).
set -euo pipefail
apt-get update -q && apt-get install -y -q python3 python3-pip python3-venv
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
/autograder/venv/bin/pip install -q -e /autograder/source
ln -sf /autograder/venv/bin/python3 /usr/local/bin/python3
