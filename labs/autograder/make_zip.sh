#!/usr/bin/env bash
# Build the zip to upload as a Gradescope "programming assignment" autograder for one lab:
#     labs/autograder/make_zip.sh 06-zero            -> autograder-06-zero.zip
# It holds setup.sh, run_autograder, the toolkit's source and the lab's tasks, data and full checks (checks.py and
# hidden_checks.py); never the solution.
set -euo pipefail
LAB="${1:?usage: labs/autograder/make_zip.sh LAB (e.g. 06-zero)}"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
test -f "$REPO/labs/$LAB/checks.py" || { echo "no lab labs/$LAB (it has no checks.py)" >&2; exit 2; }
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/source/labs/$LAB"
cp "$REPO/labs/autograder/setup.sh" "$REPO/labs/autograder/run_autograder" "$STAGE/"
cp -r "$REPO/toolkit" "$REPO/toolkit_lessons" "$REPO/jupyter-config" "$REPO/pyproject.toml" "$REPO/README.md" "$STAGE/source/"
cp "$REPO/labs/$LAB/checks.py" "$REPO/labs/$LAB/tasks.py" "$STAGE/source/labs/$LAB/"
for data in "$REPO/labs/$LAB"/*.json; do if [ -f "$data" ]; then cp "$data" "$STAGE/source/labs/$LAB/"; fi; done
if [ -f "$REPO/labs/$LAB/hidden_checks.py" ]; then cp "$REPO/labs/$LAB/hidden_checks.py" "$STAGE/source/labs/$LAB/"; fi
echo "$LAB" > "$STAGE/source/LAB"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
OUT="$PWD/autograder-$LAB.zip"
(cd "$STAGE" && python3 -m zipfile -c "$OUT" setup.sh run_autograder source)
echo "wrote $OUT: upload it as the assignment's autograder (Gradescope: Configure Autograder > Zip file upload)"
