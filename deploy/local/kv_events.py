"""The local stack's KV events (issue #22 item 4): each engine publishes what its prefix cache holds and the
router follows it, so `cache_aware` and the decider see what the engines say they hold.

vLLM publishes with `--kv-events-config` (the zmq publisher, with a replay socket that answers "every
batch from sequence N"); the router follows an instance named on `--kv-events ID=PUB|REPLAY`. vLLM's
publisher binds only a wildcard (`tcp://*:5557`: every interface) or an ipc/inproc endpoint, and
*connects* to any other address, where nobody listens (found on vllm 0.32: `tcp://127.0.0.1:PORT` published
into the void). On one host the stack uses ipc sockets in a private folder: nothing is exposed beyond this
machine's users, and no port is drawn. `--kv-events-port` (one port, the host taken from each
registration) is for engines on separate hosts. The sources are named per instance id, which the stack
assigns in order (`prefill-0`...), before the router starts. An engine added later
(`LocalStack.add_instance`) is not followed: the router's sources are fixed at its start, and the policy
treats that engine as holding nothing (no bonus, never a wrong route).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KVEventEndpoints", "plan", "router_args"]


@dataclass(frozen=True)
class KVEventEndpoints:
    """One engine's publisher (PUB) and replay (ROUTER) sockets."""

    pub: str
    replay: str

    def engine_args(self) -> tuple[str, ...]:
        """vLLM's flags: publish every batch of this engine's prefix-cache events here."""
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.pub,
            "replay_endpoint": self.replay,
        }
        return ("--kv-events-config", json.dumps(config, separators=(",", ":")))

    def source(self, instance_id: str) -> str:
        """The router's `--kv-events` item for the engine."""
        return f"{instance_id}={self.pub}|{self.replay}"


def plan(n_prefill: int, n_decode: int, folder: Path | None = None) -> dict[str, KVEventEndpoints]:
    """Sockets for the engines the stack starts with, by the instance ids they will get. The folder is a
    fresh short one under the system's temp dir by default: an ipc path has a ~107-byte limit."""
    where = folder or Path(tempfile.mkdtemp(prefix="pdgate-kv-"))
    ids = [f"prefill-{i}" for i in range(n_prefill)] + [f"decode-{i}" for i in range(n_decode)]
    return {i: KVEventEndpoints(f"ipc://{where / i}.pub", f"ipc://{where / i}.replay") for i in ids}


def router_args(endpoints: dict[str, KVEventEndpoints]) -> list[str]:
    """The router's flags that follow each engine's events."""
    out: list[str] = []
    for ident, e in endpoints.items():
        out += ["--kv-events", e.source(ident)]
    return out
