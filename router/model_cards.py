"""The instances' model cards (vLLM's `GET /v1/models` entries), learned once per instance URL.

Why: the router's own `/v1/models` must give what vLLM gives (`max_model_len`, `root`, `permission`...)
so that clients and `vllm bench serve` see no difference, and the router needs `max_model_len` to refuse
a request the engines would refuse (`validation.check_context`) before the prefill runs.

A card is fetched on first use (a request for its model, or a `GET /v1/models`), from one live
instance of the model, and kept while that instance's URL stays in the pool; a failed fetch is retried
after `RETRY_S`. Several requests that need the same card at once share one fetch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import orjson
from pdgate.router.pool import LiveInstance, Pool

from pdgate.upstream import Upstream

__all__ = ["RETRY_S", "ModelCards"]

log = logging.getLogger(__name__)

RETRY_S = 5.0
Card = dict[str, object]


class ModelCards:
    def __init__(
        self,
        pool: Pool,
        upstream: Callable[[], Upstream],
        clock: Callable[[], float],
        timeout_s: float,
        headers: Callable[[], list[tuple[bytes, bytes]]],
    ) -> None:
        self._pool = pool
        self._upstream = upstream
        self._clock = clock
        self._timeout = timeout_s
        self._headers = headers
        self._cards: dict[str, dict[str, Card]] = {}  # instance URL -> model id -> card
        self._failed: dict[str, float] = {}  # instance URL -> when its fetch failed
        self._fetching: dict[str, asyncio.Future[dict[str, Card]]] = {}
        self._by_model: dict[str, Card] = {}
        self._views: object = None  # the pool snapshot the caches were built against

    def _instances(self, model: str) -> list[LiveInstance]:
        """Live instances of `model`, available ones first (a card is the same on every instance)."""
        now = self._clock()
        found = [i for i in self._pool.instances.values() if i.view.model == model]
        return sorted(found, key=lambda i: i.unavailable(now) is not None)

    async def card(self, model: str) -> Card | None:
        """The card of `model` from one of its instances; None when none could tell.

        Per request this is one dict lookup: the cards by model are dropped only when the pool's
        snapshot is replaced (its `views` tuple changes), and then only cards of URLs that left it."""
        views = self._pool.views
        if views is not self._views:
            self._views = views
            urls = {v.url for v in views}
            for gone in self._cards.keys() - urls:
                del self._cards[gone]
            self._by_model.clear()
        found = self._by_model.get(model)
        if found is not None:
            return found
        now = self._clock()
        tried = 0
        for inst in self._instances(model):
            url = inst.view.url
            cards = self._cards.get(url)
            if cards is None:
                if now - self._failed.get(url, -RETRY_S) < RETRY_S or tried >= 2:
                    continue
                tried += 1
                cards = await self._fetch(url)
            if model in cards:
                self._by_model[model] = cards[model]
                return cards[model]
        return None

    async def max_model_len(self, model: str) -> int | None:
        found = (await self.card(model) or {}).get("max_model_len")
        return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None

    async def _fetch(self, url: str) -> dict[str, Card]:
        pending = self._fetching.get(url)
        if pending is None:
            pending = self._fetching[url] = asyncio.ensure_future(self._get(url))
            pending.add_done_callback(lambda _: self._fetching.pop(url, None))
        return await asyncio.shield(pending)

    async def _get(self, url: str) -> dict[str, Card]:
        try:
            resp = await self._upstream().request(
                "GET", url + "/v1/models", self._headers(), b"", timeout=self._timeout
            )
            try:
                data = await resp.read(timeout=self._timeout, limit=1 << 20)
            finally:
                resp.close()
            if resp.status != 200:
                raise ValueError(f"answered {resp.status}")
            cards = {
                c["id"]: c for c in orjson.loads(data)["data"] if isinstance(c, dict) and isinstance(c.get("id"), str)
            }
        except Exception as exc:
            log.info("GET %s/v1/models failed (model cards retried in %.0f s): %r", url, RETRY_S, exc)
            self._failed[url] = self._clock()
            return {}
        self._failed.pop(url, None)
        self._cards[url] = cards
        return cards
