"""Every counter the connector keeps, with what it counts: the one list of its stats names.

The scheduler half bumps them (its two sides, through `outbox.py`; workers report through it), the
stats file carries them under "counters", and `stats.py` exports each on vLLM's `/metrics` as
`pdgate_connector_<name>_total`.
A new counter is added here, then bumped where it happens. No imports: readable without vLLM.
"""

from __future__ import annotations

__all__ = ["COUNTERS"]

COUNTERS: dict[str, str] = {
    "sends_held": "prefill requests whose blocks were kept for a decode",
    "sends_freed_done": "held prefills freed because the decode pulled (DONE)",
    "sends_freed_aborted": "held prefills freed because the handoff was ABORTED",
    "sends_freed_expired": "held prefills freed because the handoff EXPIRED",
    "sends_freed_not_found": "held prefills freed because the ledger had no such handoff",
    "sends_freed_ready_failed": "held prefills freed because the ledger refused READY",
    "sends_freed_local_deadline": "held prefills freed on the local deadline (metaserver unreachable)",
    "ready_recorded": "READY records written",
    "ready_failed": "READY records refused or not written",
    "prefill_not_kept": "do_remote_decode requests that ended without KV to keep (abort, error, no blocks)",
    "recv_started": "decode requests that started a KV load",
    "recv_sync": "decode KV loads done synchronously, in the step that computes the first token (an idle "
    "engine under the router's claim)",
    "recv_ok": "decode requests whose KV was pulled and confirmed",
    "recv_failed": "decode requests whose KV load failed (reported as load errors)",
    "recv_layerwise": "decode KV loads pulled layer by layer (`layerwise_min_tokens`), per TP rank",
    "layer_waits": "waits of vLLM's forward for one layer of a layer-wise load (`wait_for_layer_load`), per TP "
    "rank: the model's layers times `recv_layerwise` when healthy",
    "layer_waits_out_of_order": "layer waits for a layer below one the same load waited for before; zero when "
    "healthy (the forward runs the layers in order)",
    "tokens_loaded": "prompt tokens loaded from prefills instead of computed",
    "blocks_pulled": "KV blocks pulled, summed over TP ranks",
    "bytes_pulled": "KV bytes pulled, summed over TP ranks",
    "pulls_failed": "failed pulls, per TP rank",
    "invalid_blocks": "local blocks reported to vLLM as failed loads",
    "claims_failed": "claims that did not succeed",
    "claims_by_router": "decode loads that pulled under the router's claim, with no claim round trip of their own",
    "claims_untrusted": "router claims named for this decode but not sealed with this connector's token's key "
    "(forged, altered, or a router under another token): the decode claimed through the metaserver itself",
    "done_refused": "DONEs the ledger refused while the KV was still held (a lapsed claim); zero when healthy",
    "done_after_end": "DONEs that came after the handoff had ended (e.g. the router aborted it for a client that left)",
    "recv_released": "handoffs a decode released without pulling (local cache, ended before scheduled)",
    "prompt_mismatch": "decode requests whose prompt does not start with the tokens the prefill's KV belongs to: "
    "the KV is released and the prompt computed here; zero when healthy",
    "bad_params": "requests with unusable kv_transfer_params",
    "registrations": "successful registrations with the metaserver",
}
