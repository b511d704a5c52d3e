"""One harness per transport: how the conformance cases start a peer, make a decode, and hurt a peer.

The cases in ``test_conformance.py`` are written once against :class:`Harness`; each harness says how its
engine does the things a case needs (a peer that dies, stalls, drops its registration) and which typed
errors its engine reports for them. NIXL and Mooncake peers run in their own process (``peer.py``),
driven with signals: SIGKILL is a death, SIGSTOP a stall. llm_datadist runs against its in-process fake
(CANN cannot run here), where the same events are the fake's: finalize, a closed gate, an unregistered cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pdgate.connector.transport.base import Transport
from pdgate.connector.transport.errors import (
    LinkError,
    PeerUnreachable,
    RemoteKVMissing,
    TransportError,
)

from tests.transport_conformance.layout import (
    BLOCK_LEN,
    NUM_BLOCKS,
    decode_buffers,
    decode_regions,
    peer_block,
    peer_buffer,
    peer_regions,
)
from tests.transport_conformance.peer import PREFIX

REPO = Path(__file__).resolve().parents[2]


class Decode:
    """A decode-side transport and the buffers behind its regions (kept alive here)."""

    def __init__(self, transport: Transport, bufs: list[np.ndarray]) -> None:
        self.t = transport
        self.bufs = bufs
        transport.register(decode_regions(bufs))

    def block(self, region: int, block: int) -> np.ndarray:
        out: np.ndarray = self.bufs[region].reshape(NUM_BLOCKS, BLOCK_LEN)[block]
        return out


class Peer:
    """A prefill rank serving ``peer_buffer(seed)``; subclasses say how it dies, stalls and deregisters."""

    layout = "interleaved"
    address: dict[str, Any]

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.buf = peer_buffer(seed)

    def block(self, region: int, block: int) -> np.ndarray:
        return peer_block(self.buf, self.layout, region, block)

    def kill(self) -> None:
        raise NotImplementedError

    def stall(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def deregister(self) -> None:
        raise NotImplementedError


class Harness:
    """What a case needs from a transport. ``*_errors``: the typed errors the engine may report."""

    kind: str
    dead_errors: tuple[type[TransportError], ...] = (PeerUnreachable,)
    #: A peer whose transport closed while its process lives on: its memory is deregistered.
    deregistered_errors: tuple[type[TransportError], ...] = (PeerUnreachable, RemoteKVMissing)
    #: The least time a stalled pull takes to fail (the deadline the harness configured).
    stall_floor_s: float = 0.0
    #: Pulls address remote blocks by key, not by the published addresses (llm_datadist's caches).
    addresses_by_key = False

    def __init__(self) -> None:
        self.decodes: list[Decode] = []

    def peer(self, seed: int) -> Peer:
        raise NotImplementedError

    def decode(self, *, stall_deadline: bool = False) -> Decode:
        """A decode transport (closed with the harness); ``stall_deadline``: with the short deadline the
        stall cases wait out."""
        made = self._new_decode(stall_deadline)
        self.decodes.append(made)
        return made

    def _new_decode(self, stall_deadline: bool) -> Decode:
        raise NotImplementedError

    def close(self) -> None:
        """Close every decode, then stop every peer this harness started."""
        for made in self.decodes:
            made.t.close()
        self._stop_peers()

    def _stop_peers(self) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------
# Engines with peers in their own process
# ------------------------------------------------------------------------------------------


class ProcessPeer(Peer):
    def __init__(self, seed: int, kind: str, options: dict[str, Any], env: dict[str, str]) -> None:
        super().__init__(seed)
        cmd = [sys.executable, "-m", "tests.transport_conformance.peer", "--kind", kind, "--seed", str(seed)]
        self.proc = subprocess.Popen(
            [*cmd, "--options", json.dumps(options)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        hello = self._next_message()
        self.pid: int = hello["pid"]
        self.address = hello["address"]

    def _next_message(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                msg: dict[str, Any] = json.loads(line[len(PREFIX) :])
                return msg
        self.proc.wait(timeout=10)
        raise RuntimeError(f"peer exited with {self.proc.returncode} before answering")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too; a SIGCONT first would let it serve a read
        self.proc.wait(timeout=10)

    def stall(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def deregister(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("deregister\n")
        self.proc.stdin.flush()
        assert self._next_message() == {"deregistered": True}


class ProcessHarness(Harness):
    """Peers in subprocesses; the decode in this process, both under ``env`` (set by the fixture)."""

    env_vars: ClassVar[dict[str, str]] = {}  # what the fixture sets for both sides

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__()
        self.env = env
        self.peers: list[ProcessPeer] = []

    def peer_options(self, seed: int) -> dict[str, Any]:
        raise NotImplementedError

    def peer(self, seed: int) -> Peer:
        peer = ProcessPeer(seed, self.kind, self.peer_options(seed), self.env)
        self.peers.append(peer)
        return peer

    def _stop_peers(self) -> None:
        for peer in self.peers:
            peer.kill()


class NixlHarness(ProcessHarness):
    """NIXL over UCX's TCP transport on loopback (``UCX_TLS=tcp``): the network path, where a stopped
    peer holds a READ open (same-host CMA would read a stopped process's memory without it)."""

    kind = "nixl"
    env_vars: ClassVar[dict[str, str]] = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    stall_floor_s = 0.9

    def peer_options(self, seed: int) -> dict[str, Any]:
        return {"agent_name": f"conformance-peer-{seed}", "pull_timeout_s": 10.0}

    def _new_decode(self, stall_deadline: bool) -> Decode:
        from pdgate.connector.transport.nixl import NixlTransport

        return Decode(NixlTransport(pull_timeout_s=1.0 if stall_deadline else 10.0), decode_buffers())


class MooncakeHarness(ProcessHarness):
    """Mooncake over protocol tcp on loopback. A stall ends at the engine's progress deadline (2 s here)."""

    kind = "mooncake"
    env_vars: ClassVar[dict[str, str]] = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "2", "GLOG_minloglevel": "1"}
    stall_floor_s = 1.8

    def peer_options(self, seed: int) -> dict[str, Any]:
        return {"hostname": "127.0.0.1", "protocol": "tcp"}

    def _new_decode(self, stall_deadline: bool) -> Decode:
        from pdgate.connector.transport.mooncake import MooncakeTransport

        return Decode(MooncakeTransport(hostname="127.0.0.1", protocol="tcp", pull_timeout_s=10.0), decode_buffers())


# ------------------------------------------------------------------------------------------
# llm_datadist through its fake, in this process
# ------------------------------------------------------------------------------------------


class FakePeer(Peer):
    layout = "dense"  # llm_datadist describes each region as one dense tensor

    def __init__(self, seed: int, cluster_id: int) -> None:
        from pdgate.connector.transport.llmdatadist import LLMDataDistTransport

        from tests.fakes import fake_llmdatadist as fake

        super().__init__(seed)
        self.fake = fake
        self.t = LLMDataDistTransport(
            role="prefill", cluster_id=cluster_id, device_id=0, device_ip=f"10.0.0.{cluster_id}", llm_datadist=fake
        )
        self.t.register(peer_regions(self.buf, self.layout))
        self.address = self.t.local_address()

    def kill(self) -> None:
        self.t.close()  # finalize: the peer's side of every link is gone
        self.resume()

    def stall(self) -> None:
        self.fake.WORLD.faults.gate = threading.Event()

    def resume(self) -> None:
        gate = self.fake.WORLD.faults.gate
        if gate is not None:
            gate.set()

    def deregister(self) -> None:
        self.t.close()  # unregisters its caches and finalizes; this process keeps the bytes


class LLMDataDistHarness(Harness):
    kind = "llmdatadist"
    dead_errors = (LinkError, PeerUnreachable)
    deregistered_errors = (LinkError, PeerUnreachable)
    stall_floor_s = 0.9
    addresses_by_key = True

    def __init__(self) -> None:
        from tests.fakes import fake_llmdatadist as fake

        super().__init__()
        self.fake = fake
        fake.reset()
        fake.WORLD.faults.gate_timeout_s = 1.0  # the engine's sync_kv_timeout, as the stall cases see it
        self.peers: list[FakePeer] = []
        self.next_cluster = 1

    def peer(self, seed: int) -> Peer:
        self.next_cluster += 1
        peer = FakePeer(seed, self.next_cluster)
        self.peers.append(peer)
        return peer

    def _new_decode(self, stall_deadline: bool) -> Decode:
        from pdgate.connector.transport.llmdatadist import LLMDataDistTransport

        self.next_cluster += 1
        t = LLMDataDistTransport(
            role="decode",
            cluster_id=100 + self.next_cluster,
            device_id=0,
            device_ip=f"10.0.1.{self.next_cluster}",
            llm_datadist=self.fake,
        )
        return Decode(t, decode_buffers())

    def _stop_peers(self) -> None:
        for peer in self.peers:
            peer.resume()
            peer.t.close()
        self.fake.reset()
