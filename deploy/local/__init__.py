"""pdgate on one machine: a tiny model, real vLLM prefill and decode engines, the router.

`launcher.py` is the `pdgate-local` command (up / status / down / model / venv); `stack.py` is the
reusable `LocalStack` that the launcher, the end-to-end tests and `bench/e2e.py` share, so all three start
exactly the same processes; `state.py` is what `up` leaves for `status` and `down` (README.md: the
reading path).
"""
