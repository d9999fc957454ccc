#!/bin/bash
# The same script, grown from 2 to 3 workers and shrunk back, from the command line: the
# joining worker runs examples/mnist1d_adamw.py with these same arguments, builds its model
# while the others train, and enters the loop at the current step with the synced state.
#
#   bash examples/elastic.sh              # uses .venv's mpiexec and python when present
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MPIEXEC=${MPIEXEC:-$( [ -x .venv/bin/mpiexec ] && echo .venv/bin/mpiexec || echo mpiexec )}
exec "$MPIEXEC" -n 2 "$PY" examples/mnist1d_adamw.py --epochs "${EPOCHS:-25}" \
    --max-workers 3 --policy resize-schedule --resize-schedule-steps 5:3,120:2 \
    --resize-schedule-hold 60 --check-replicas --metrics-file "${METRICS:-elastic.jsonl}" "$@"
