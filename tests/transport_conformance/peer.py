"""A conformance peer in its own process: a prefill rank serving seeded bytes over a real transport.

Run as ``python -m tests.transport_conformance.peer --kind nixl|mooncake --seed N --options JSON``. It
registers ``layout.peer_buffer(seed)`` (interleaved K/V), prints ``{"pid", "address"}`` as one line
prefixed with ``PREFIX`` (engines log to stdout too), then polls every 0.5 ms (the prefill side must make
progress). Commands on stdin, one per line: ``deregister`` closes the transport (which deregisters the
buffer) while the process and its bytes live on, and answers ``{"deregistered": true}``. End of stdin:
close the transport and exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from pdgate.connector.transport import transport_class

from tests.transport_conformance.layout import peer_buffer, peer_regions

PREFIX = "PDGATE-PEER "


def emit(msg: dict[str, object]) -> None:
    print(PREFIX + json.dumps(msg), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--options", default="{}")
    args = ap.parse_args()
    buf = peer_buffer(args.seed)
    transport = transport_class(args.kind)(**json.loads(args.options))
    transport.register(peer_regions(buf, "interleaved"))
    emit({"pid": os.getpid(), "address": transport.local_address()})

    commands: list[str] = []
    stop = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.append(line.strip())
        stop.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    while not stop.is_set():
        transport.poll()
        transport.drain_served()
        while commands:
            if commands.pop(0) == "deregister":
                transport.close()  # deregisters; poll() and drain_served() are no-ops from now on
                emit({"deregistered": True})
        time.sleep(0.0005)
    transport.close()


if __name__ == "__main__":
    main()
