#!/usr/bin/env bash
# The workflow tools and frameworks the conformance tests drive (tests/tools-requirements.txt:
# Snakemake and its Slurm executor plugin, PyTorch's CPU build), unchanged and pinned, in
# their own virtual environment (.venv-tools, or $TOOLS_VENV): Snakemake pins SQLAlchemy
# below 2.1, which Phalanx's own environment cannot take. They reach Phalanx only through its
# Slurm commands, as at a site.
# Does nothing when the environment already holds exactly these pins.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${TOOLS_VENV:-$here/.venv-tools}
req=$here/tests/tools-requirements.txt
stamp=$venv/.installed
if [ -f "$stamp" ] && cmp -s "$req" "$stamp"; then
    exit 0
fi
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -r "$req"
cp "$req" "$stamp"
echo "workflow tools installed in $venv"
