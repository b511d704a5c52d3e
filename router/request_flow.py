"""The state of one proxied request, in one explicit object shared by the proxy, the attempts and the
disconnect watcher: who asked, what is being sent, which handoff is live, and how the request ends."""

from __future__ import annotations

import os
from typing import Any

from pdgate.router.bodies import RequestFacts, SplicedBody
from pdgate.router.decider import Slo
from pdgate.router.pool import LiveInstance
from pdgate.router.resume import StreamTrack

from pdgate.contract import KVTransferParams

__all__ = ["MAX_ANSWER", "ProxiedRequest", "mint_transfer_id"]

MAX_ANSWER = 64 << 20  # an engine answer larger than this is a failed answer, not one to buffer


_UNPARSED = RequestFacts(endpoint="", model=None, stream=False, prompt_tokens=0, max_tokens=0, prefix=b"")


def mint_transfer_id() -> str:
    """'pd-' + 128 random bits: nobody can guess the next id to create or squat it before the router
    does (a process prefix plus a counter could be read off one answer and pre-created)."""
    return "pd-" + os.urandom(16).hex()


_NO_SLO = Slo()


class ProxiedRequest:
    """One client request on its way through prefill and decode.

    `live` is the transfer id of a handoff this request created and still owns: whoever ends the request
    aborts it (with `abort_reason`) unless a decode finished it. `decode_kv` is the decode's
    `kv_transfer_params` before the router's claim (added per decode attempt); `spliced` is the body
    encoded once, onto which each hop's payload splices its own fields (`bodies.SplicedBody`);
    `last_decode` is the decode of the attempt before, which the router gave up on, so its claim may be
    taken back for the next one. `started` says the response's status line went out, after which nothing
    is retried and errors are reported in the stream; after a first token from the prefill
    (`first_token`) the status line is out before the decode is asked, and a decode may still be retried
    until its own first byte.
    """

    __slots__ = (
        "abort_reason",
        "asked_ids",
        "body",
        "client_auth",
        "decode_kv",
        "decode_kv_json",
        "disconnected",
        "endpoint",
        "extra",
        "facts",
        "finished",
        "first_token",
        "kv_key",
        "last_decode",
        "ledger_prefill",
        "limit",
        "live",
        "notes",
        "overhead_s",
        "prefill",
        "prefill_answer",
        "prefill_at",
        "prefill_kv",
        "resumes",
        "rid",
        "slo",
        "spliced",
        "started",
        "tid",
        "track",
        "tried",
        "weight",
        "whole_at",
    )

    def __init__(
        self, endpoint: str, tid: str, rid: bytes, client_auth: bytes | None, extra: list[tuple[bytes, bytes]]
    ) -> None:
        self.endpoint = endpoint
        self.tid = tid
        self.rid = rid
        self.client_auth = client_auth  # forwarded to engines only with --forward-client-auth
        self.extra = extra  # trace headers passed through to the engines
        self.slo = _NO_SLO  # the client's x-slo-ttft-ms / x-slo-tpot-ms (the decider's input)
        self.body: dict[str, Any] = {}
        self.facts = _UNPARSED  # set once the body is parsed
        self.kv_key = 0
        self.live: str | None = None
        self.prefill: LiveInstance | None = None
        self.prefill_answer: dict[str, Any] | None = None  # the prefill's answer, parsed (what it adds)
        self.prefill_kv: KVTransferParams | None = None  # its kv_transfer_params, parsed (`attempts`)
        self.decode_kv: dict[str, Any] = {}
        self.decode_kv_json = b"{}"  # `decode_kv` encoded, checked at the prefill (`attempts`)
        self.spliced: SplicedBody | None = None  # the body encoded once for both hops (set at the first prefill)
        self.last_decode: str | None = None
        self.ledger_prefill = False  # the prefill's answer named the handoff: it records READY, claim it
        self.first_token = False  # asked the prefill for token ids: its first token may go out first
        self.limit: int | None = None  # the model's max_model_len, when its card says it
        self.abort_reason = "failed"
        self.overhead_s = 0.0  # the router's own time before the decode was asked, for the overhead histogram
        self.disconnected = False
        self.finished = False
        self.started = False
        self.asked_ids = False  # the client asked for return_token_ids (the router may ask for them itself)
        self.track: StreamTrack | None = None  # a resumable stream's record of what the client got (`resume`)
        self.resumes = 0  # times its stream was resumed on another instance
        self.whole_at: LiveInstance | None = None  # where the decider weighed it whole (run there first)
        self.prefill_at: LiveInstance | None = None  # the prefill the decider weighed (PD's first try)
        self.tried: list[str] = []  # the instances whose answering attempt failed: a whole retry skips them
        self.weight = 1  # engine requests it counts against --max-inflight (prompts x n, `fanout.admit`)
        self.notes: dict[str, Any] | None = None  # the client request's ASGI scope: the access log's note

    def end(self) -> None:
        """Called right before the last body message: a disconnect after this is not a cancellation."""
        self.finished = True
