"""Redis store URLs: one Redis, a Sentinel-managed master, or a Redis Cluster; and the clients for them.

    redis://[[user]:password@]host:port/db[?prefix=NAME&...]       one Redis (`rediss://` TLS, `unix://`)
    redis+sentinel://[[user]:password@]h1:26379,h2:26379/SERVICE[/db][?prefix=NAME&...]
    redis+cluster://[[user]:password@]h1:7000,h2:7001[/0][?prefix=NAME&buckets=64&...]

`rediss+sentinel://` and `rediss+cluster://` use TLS to every server (Sentinels too). The user and
password in the URL are the data servers'; Sentinels take their own (`sentinel_username`,
`sentinel_password`; none by default, as Sentinel's own `requirepass` is usually separate).

`wait_replicas=N` (one Redis or Sentinel; with `wait_timeout_ms`, default 1000) makes every ledger write
wait, in the same round trip, until N replicas hold it (`pipeline.Pipeliner`), and answer 503 when they
do not in time: a failover then cannot take back a transition already answered, but ledger writes stop
while fewer than N replicas are up. Without it replication is asynchronous, and a master that dies may
take its last acknowledged writes with it (deploy/README.md, "Durability").

Why our own parser for the Sentinel and Cluster forms: redis-py reads only single-server URLs. Plain
`redis://` URLs still go to redis-py as they are (less our `prefix`), so every option it reads there keeps
working. For the other two, the options below are the ones accepted; an unknown one is an error at
start-up rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from pdgate.metaserver.store.keys import DEFAULT_PREFIX
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ConstantBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = ["DEFAULT_BUCKETS", "Client", "RedisTarget", "connect", "parse_store_url"]

Mode = Literal["single", "sentinel", "cluster"]
Client = aioredis.Redis | RedisCluster

DEFAULT_BUCKETS = 64
_DEFAULT_PORT = {"sentinel": 26379, "cluster": 6379}

# Query options of the Sentinel and Cluster forms -> how to read them (redis-py keyword = the same name).
_TLS_OPTIONS = {
    "ssl_ca_certs": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": str,  # none | optional | required
    "ssl_check_hostname": lambda v: v.lower() in ("1", "true", "yes"),
}
_COMMON_OPTIONS: dict[str, Any] = {**_TLS_OPTIONS, "max_connections": int, "client_name": str}
_OURS = ("prefix", "wait_replicas", "wait_timeout_ms")  # read here, never handed to redis-py


@dataclass(frozen=True)
class RedisTarget:
    """What a store URL names: where the data lives and how to authenticate to it."""

    mode: Mode
    prefix: str = DEFAULT_PREFIX
    url: str = ""  # single: the URL handed to redis-py (without `prefix`)
    nodes: tuple[tuple[str, int], ...] = ()  # sentinel: the Sentinels; cluster: startup nodes
    service: str = ""  # sentinel: the monitored master's name
    db: int = 0
    buckets: int = 1  # ledger shards (cluster only)
    wait_replicas: int = 0  # WAIT after each ledger write batch (single / sentinel)
    wait_timeout_ms: int = 1000
    options: dict[str, Any] = field(default_factory=dict)  # data-server connection keywords
    sentinel_options: dict[str, Any] = field(default_factory=dict)


def _nodes(netloc: str, mode: Mode) -> tuple[tuple[str, int], ...]:
    hosts = netloc.rsplit("@", 1)[-1]
    out = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        host = host.strip("[]")
        if not host:
            raise ValueError(f"empty host in {netloc!r}")
        try:
            out.append((host, int(port) if port else _DEFAULT_PORT[mode]))
        except ValueError:
            raise ValueError(f"bad port in {item!r}") from None
    return tuple(out)


def parse_store_url(url: str) -> RedisTarget:
    """The target of a `redis*://` or `unix://` store URL; ValueError saying what is wrong."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = dict((k, v) for k, v in query if k in _OURS)
    prefix = ours.get("prefix", DEFAULT_PREFIX)
    wait_replicas = int(ours.get("wait_replicas", 0))
    wait_timeout_ms = int(ours.get("wait_timeout_ms", 1000))
    rest = [(k, v) for k, v in query if k not in _OURS]
    if wait_replicas and "+cluster" in scheme:
        raise ValueError("wait_replicas is for one Redis or Sentinel: a cluster cannot route WAIT")
    if "+" not in scheme:
        url = urlunsplit(parts._replace(query=urlencode(rest)))
        return RedisTarget("single", prefix, url=url, wait_replicas=wait_replicas, wait_timeout_ms=wait_timeout_ms)
    base, _, kind = scheme.partition("+")
    if base not in ("redis", "rediss") or kind not in ("sentinel", "cluster"):
        raise ValueError(f"unknown store URL scheme {scheme!r}")
    mode: Mode = "sentinel" if kind == "sentinel" else "cluster"
    options: dict[str, Any] = {}
    sentinel_options: dict[str, Any] = {}
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    if base == "rediss":
        options["ssl"] = True
    buckets = DEFAULT_BUCKETS if mode == "cluster" else 1
    for k, v in rest:
        if k in _COMMON_OPTIONS:
            options[k] = _COMMON_OPTIONS[k](v)
        elif mode == "sentinel" and k in ("sentinel_username", "sentinel_password"):
            sentinel_options[k.removeprefix("sentinel_")] = v
        elif mode == "cluster" and k == "buckets":
            buckets = int(v)
        else:
            raise ValueError(f"unknown option {k!r} in a {scheme}:// store URL")
    path = [p for p in parts.path.split("/") if p]
    service, db = "", 0
    if mode == "sentinel":
        if not path:
            raise ValueError(f"{scheme}:// needs the master's name: {scheme}://h1:26379,h2:26379/NAME/0")
        service = unquote(path[0])
        db = int(path[1]) if len(path) > 1 else 0
    elif path:
        db = int(path[0])
        if db != 0:
            raise ValueError("a Redis Cluster has only database 0")
    if len(path) > (2 if mode == "sentinel" else 1):
        raise ValueError(f"unexpected path in {url!r}")
    if base == "rediss":  # Sentinels speak TLS too; they get the same certificates
        sentinel_options.update({k: v for k, v in options.items() if k.startswith("ssl")})
    return RedisTarget(
        mode,
        prefix,
        wait_replicas=wait_replicas,
        wait_timeout_ms=wait_timeout_ms,
        nodes=_nodes(parts.netloc, mode),
        service=service,
        db=db,
        buckets=buckets,
        options=options,
        sentinel_options=sentinel_options,
    )


def connect(target: RedisTarget, *, socket_timeout: float | None, max_connections: int) -> Client:
    """A client for `target`. One quick reconnect covers a pooled connection that died with its server; a
    server that stays down (or a failover under way) answers at once, so callers get 503 instead of
    waiting through a long backoff. Sentinel clients ask the Sentinels for the master on every new
    connection, so they follow a failover by themselves; Cluster clients follow MOVED/ASK."""
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": 1.0,
        "socket_timeout": socket_timeout,
        "retry": Retry(ConstantBackoff(0.02), 1),
    }
    opts = {"max_connections": max_connections, **target.options}
    if target.mode == "single":
        return aioredis.Redis.from_url(
            target.url, **common, retry_on_error=[RedisConnectionError], max_connections=max_connections
        )
    if target.mode == "sentinel":
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # annotated from redis-py 8
            list(target.nodes),
            # No retries against a Sentinel: the client already goes round all of them, and redis-py's
            # default retries with backoff held a call for ~25 s when every Sentinel refused it.
            sentinel_kwargs={
                "socket_connect_timeout": 1.0,
                "socket_timeout": 1.0,
                "retry": Retry(NoBackoff(), 0),
                **target.sentinel_options,
            },
        )
        master: aioredis.Redis = sentinel.master_for(
            target.service, **common, retry_on_error=[RedisConnectionError], db=target.db, **opts
        )
        return master
    startup = [ClusterNode(host, port) for host, port in target.nodes]
    return RedisCluster(startup_nodes=startup, **common, **opts)
