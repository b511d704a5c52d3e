"""`Admin`: the HTTP calls of the `pdgate` command, to the router and the metaserver, with their failures
worded for an operator (`CliError`: what failed, and which setting to check).

The data sources are the services' own admin surfaces, nothing the command computes itself: the
metaserver's registry (`GET /v1/instances`, `POST /v1/instances/{id}/drain|undrain`), its ledger
(`GET /v1/handoffs/{id}`) and its `/metrics` (live handoffs by state), the router's admin `/health` (its
pool: availability, breaker, in-flight) and its `/metrics` (phase latencies).
"""

from __future__ import annotations

from typing import Any

import httpx
from pdgate.cli.settings import CliSettings
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Admin", "CliError", "Samples", "engine_metrics", "parse_metrics"]

# (metric name, labels as sorted pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class CliError(Exception):
    """A failure the command reports in one line (exit status 1)."""


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text page, by name and labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def engine_metrics(admin: Admin, url: str) -> Samples | None:
    """An engine's /metrics page, parsed (None: no answer, not 200, or not Prometheus text): what the
    doctor reads of vLLM's own numbers and the connector's counters."""
    try:
        resp = admin.get(url.rstrip("/") + "/metrics")
        if resp.status_code != 200:
            return None
        return parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError):
        return None


class Admin:
    """One HTTP client for one command run (sync: the command does a few calls and prints)."""

    def __init__(self, s: CliSettings, transport: httpx.BaseTransport | None = None) -> None:
        self.s = s
        self._http = httpx.Client(timeout=s.timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------
    def _url(self, which: str) -> tuple[str, str | None]:
        base = self.s.router if which == "router" else self.s.meta_url
        if base is None:
            flag = "--router" if which == "router" else "--metaserver (or --router)"
            raise CliError(f"no {which} URL: give {flag}, PDGATE_CLI_{which.upper()}, or a config file (pdgate config)")
        return base.rstrip("/"), (self.s.token if which == "router" else self.s.meta_token)

    def call(self, which: str, method: str, path: str, **kw: Any) -> httpx.Response:
        """One call; a refused token or an unreachable service is a `CliError` naming the fix."""
        base, token = self._url(which)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            resp = self._http.request(method, base + path, headers=headers, **kw)
        except httpx.HTTPError as exc:
            raise CliError(f"the {which} at {base} cannot be reached ({type(exc).__name__}: {exc})") from None
        if resp.status_code in (401, 403):
            raise CliError(
                f"the {which} at {base} refused the token ({resp.status_code} on {method} {path}): give its admin "
                f"token with --token or PDGATE_CLI_TOKEN" + (" (or --metaserver-token)" if which != "router" else "")
            )
        return resp

    def _json(self, which: str, method: str, path: str, ok: tuple[int, ...] = (200,)) -> Any:
        resp = self.call(which, method, path)
        if resp.status_code not in ok:
            raise CliError(f"{method} {path} on the {which}: {resp.status_code} {_detail(resp)}")
        return resp.json()

    def get(self, url: str) -> httpx.Response:
        """A GET of any URL (an engine's), without the admin token: engines must never see it."""
        return self._http.get(url)

    # -- the data ---------------------------------------------------------------------------
    def instances(self, role: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        params = "&".join(f"{k}={v}" for k, v in (("role", role), ("state", state)) if v)
        found: list[dict[str, Any]] = self._json("metaserver", "GET", "/v1/instances" + (f"?{params}" * bool(params)))[
            "instances"
        ]
        return found

    def router_health(self) -> dict[str, Any]:
        """The router's /health body (200 or 503 both carry it); its pool rows by id with the admin token."""
        resp = self.call("router", "GET", "/health")
        if resp.status_code not in (200, 503):
            raise CliError(f"GET /health on the router: {resp.status_code} {_detail(resp)}")
        body: dict[str, Any] = resp.json()
        return body

    def metrics(self, which: str) -> Samples:
        resp = self.call(which, "GET", "/metrics")
        if resp.status_code != 200:
            raise CliError(f"GET /metrics on the {which}: {resp.status_code} {_detail(resp)}")
        return parse_metrics(resp.text)

    def handoff(self, transfer_id: str) -> dict[str, Any]:
        found: dict[str, Any] = self._json("metaserver", "GET", f"/v1/handoffs/{transfer_id}")
        return found

    def handoffs(self, state: str | None, limit: int) -> list[dict[str, Any]]:
        """Live handoff records (`GET /v1/handoffs`, admin token), the nearest lease end first."""
        query = f"?limit={limit}" + (f"&state={state}" if state else "")
        found: list[dict[str, Any]] = self._json("metaserver", "GET", "/v1/handoffs" + query)["handoffs"]
        return found

    def handoff_counts(self) -> dict[str, int]:
        """Live handoffs by state (the metaserver's store-wide gauge, read at scrape time)."""
        samples = self.metrics("metaserver")
        return {
            dict(labels)["state"]: int(v)
            for (name, labels), v in samples.items()
            if name == "pdgate_metaserver_handoffs" and "state" in dict(labels)
        }

    def set_drain(self, instance_id: str, drain: bool) -> dict[str, Any]:
        verb = "drain" if drain else "undrain"
        found: dict[str, Any] = self._json("metaserver", "POST", f"/v1/instances/{instance_id}/{verb}")
        return found


def _detail(resp: httpx.Response) -> str:
    """The error body's words (RFC 7807 `detail`, OpenAI `error.message`), else its first 200 bytes."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "detail" in body:
            return str(body["detail"])
    return resp.text[:200]
