"""Clients the network-namespace rehearsal runs inside the head's namespace, where an operator or an
application on the head host would be. Each command prints one JSON line on stdout.

Polling happens here, in one process, rather than by starting a process per attempt: under load a
Python start costs a second, which would blur the lease bound the rehearsal checks.

    python -m tests.deploy.head_client COMMAND ARGS...
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import httpx

METASERVER = "http://metaserver:8300"  # compose service names: /etc/netns/<head>/hosts
ROUTER = "http://router:8000"


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def instances(token: str) -> list[str]:
    r = httpx.get(f"{METASERVER}/v1/instances", headers=_auth(token), timeout=5)
    r.raise_for_status()
    return sorted(i["id"] for i in r.json()["instances"])


def instance(token: str, instance_id: str) -> dict[str, Any] | None:
    r = httpx.get(f"{METASERVER}/v1/instances/{instance_id}", headers=_auth(token), timeout=5)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    record: dict[str, Any] = r.json()
    return record


def router_health(token: str = "") -> dict[str, Any]:
    """The router's /health as the admin reads it (an anonymous caller reads opaque names, not ids)."""
    r = httpx.get(f"{ROUTER}/health", headers=_auth(token) if token else {}, timeout=5)
    available = sorted(i["id"] for i in r.json()["instances"] if i["available"])
    return {"status": r.status_code, "available": available}


def wait_instances(token: str, expected: str, timeout: str) -> list[str]:
    """Poll the registry until it lists exactly `expected` (JSON list); print the last answer."""
    want = sorted(json.loads(expected))
    deadline = time.monotonic() + float(timeout)
    while True:
        try:
            got = instances(token)
        except httpx.HTTPError:
            got = []
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def wait_router(expected: str, timeout: str, token: str = "") -> dict[str, Any]:
    """Poll the router's /health until it is ready with exactly `expected` available; print the last."""
    want = {"status": 200, "available": sorted(json.loads(expected))}
    deadline = time.monotonic() + float(timeout)
    while True:
        try:
            got = router_health(token)
        except (httpx.HTTPError, ValueError, KeyError):
            got = {}
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def watch_gone(token: str, instance_id: str, timeout: str) -> dict[str, Any]:
    """Say "watching" once the record is seen, then poll until it is gone: print when (epoch seconds)."""
    deadline = time.monotonic() + float(timeout)
    print(json.dumps({"watching": instance(token, instance_id) is not None}), flush=True)
    while time.monotonic() < deadline:
        if instance(token, instance_id) is None:
            return {"gone_at": time.time()}
        time.sleep(0.05)
    return {"gone_at": None}


def complete(model: str, n: str, tag: str) -> dict[str, Any]:
    """N completions with the official client, then one streamed (SSE through the bridge)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{ROUTER}/v1", api_key="rehearsal", max_retries=0, timeout=30)
    texts = []
    for i in range(int(n)):
        prompt = f"{tag} request {i}: " + "word " * (i + 3)
        texts.append(client.completions.create(model=model, prompt=prompt, max_tokens=8).choices[0].text)
    stream = client.completions.create(model=model, prompt=f"{tag} streamed", max_tokens=8, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    return {"answered": sum(1 for t in texts if t), "streamed": bool(streamed)}


def sim_counts(*urls: str) -> dict[str, int]:
    """Completions each pdgate-sim engine served so far (GET /sim/stats)."""
    return {url: sum(httpx.get(f"{url}/sim/stats", timeout=5).json()["by_rank"]) for url in urls}


COMMANDS = {
    "instances": instances,
    "instance": instance,
    "router-health": router_health,
    "wait-instances": wait_instances,
    "wait-router": wait_router,
    "watch-gone": watch_gone,
    "complete": complete,
    "sim-counts": sim_counts,
}


def main(argv: list[str]) -> int:
    command, *args = argv
    print(json.dumps(COMMANDS[command](*args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
