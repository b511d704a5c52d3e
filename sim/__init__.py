"""pdgate-sim (`pdgate.sim`): a fast fake vLLM engine speaking the OpenAI API and the PD protocol, with scripted faults.

What it does, per request (raw ASGI on uvicorn, orjson; thousands of concurrent streams per process):
- `kv_transfer_params.do_remote_decode` -> prefill: wait `prefill_delay`, "allocate" blocks, record READY
  in the ledger (`mark_ready` with a `KVLocation` whose `engine_id` is this instance/rank), answer one
  token with `kv_transfer_params` describing the blocks (`remote_engine_id`, `remote_block_ids`, ...).
- `kv_transfer_params.do_remote_prefill` -> decode: claim the handoff (long-poll while PENDING, poll
  while another decode holds it), check that the params came from the prefill that holds the handoff
  (`location.engine_id == handoff.prefill_instance_id == params.remote_engine_id`; a mismatch is an
  error and is counted), mark DONE, then answer `max_tokens` tokens, streamed or not.
- no params -> a plain (aggregated) completion.
Tokens are derived from the prompt (same prompt, same text); usage is counted in words.

The ledger is the metaserver named by `kv_transfer_params.metaserver`, else `--metaserver`; with
neither, prefill and decode skip the ledger steps (decode still requires `remote_engine_id`).
With `--metaserver` the sim registers one record per DP rank (`<id>` or `<id>.dp<rank>`), heartbeats
with its in-flight load, and deregisters on clean shutdown. A request for DP rank r comes with
`X-data-parallel-rank: r`.

Faults are scripted, never random: `--fail-first N` (the next N requests answer `--fail-status`),
`--fail-rate R` (exactly every 1/R-th request fails), `--die-after-tokens N` (drop the connection after N
tokens), `--hang` (never answer), `--no-kv-params` (a prefill that forgets its params),
`--decode-delay S` (wait before claiming), `--unhealthy` (GET /health answers 503),
`--health-delay S` (GET /health answers late). Tests change them at
run time with `POST /sim/script` and read counters at `GET /sim/stats`.

A request field of the wrong type or range gets a 400, as from vLLM, never a 5xx (`wire.validate_completion`).

Modules: `app` (ASGI app, completions, `main`), `ledger` (registry and handoff steps), `holds` (the KV
blocks a prefill keeps), `settings` (flags, fault script, counters), `wire` (OpenAI bodies and checks).
It is a tool for tests, benchmarks and rehearsals, not part of the gateway: the router never imports it.
"""
