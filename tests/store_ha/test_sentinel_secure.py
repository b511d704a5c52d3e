"""Sentinel over TLS with passwords: the credentials and certificates of a `rediss+sentinel://` URL reach
both the Sentinels and the data servers (real servers with no plain port), and a wrong one is a typed 503."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import closing

import pytest
from pdgate.metaserver.errors import StoreUnavailable
from pdgate.metaserver.store import open_store
from pdgate.metaserver.store.redis import RedisStore

from pdgate.errors import Code
from pdgate.models import HandoffCreate, HandoffState
from tests.store_ha.secure import DATA_PASSWORD, SENTINEL_PASSWORD, SecureSentinelGroup
from tests.store_ha.servers import wait_for

pytestmark = pytest.mark.store_ha


@pytest.fixture(scope="module")
def secure_group() -> Iterator[SecureSentinelGroup]:
    with closing(SecureSentinelGroup().start()) as group:
        yield group


async def test_the_ledger_runs_over_tls_with_both_passwords(secure_group: SecureSentinelGroup) -> None:
    store = open_store(secure_group.url(f"t{uuid.uuid4().hex[:8]}"))
    try:
        await store.ping()
        rec = await store.create_handoff(
            HandoffCreate(prefill_instance_id="p0"),
            transfer_id="s1",
            now=time.time(),
            pending_lease_s=5,
            ready_lease_s=5,
        )
        assert rec.state is HandoffState.PENDING
        # It landed on the master the Sentinels named, and reached the replica over TLS replication.
        assert isinstance(store, RedisStore)
        key = store.keys.handoff("s1")
        assert secure_group.cli(secure_group.master_port, DATA_PASSWORD, "exists", key) == "1"
        wait_for("replicated", lambda: secure_group.data_cli(secure_group.replica_port, "exists", key) == "1")
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (f":{DATA_PASSWORD}@", ":wrong@"),  # the data servers refuse it
        (f"sentinel_password={SENTINEL_PASSWORD}", "sentinel_password=wrong"),  # the Sentinels refuse it
        ("&ssl_ca_certs=", "&ssl_ca_certs=/nonexistent-ca"),  # the certificate cannot be checked
    ],
)
async def test_a_wrong_credential_is_a_typed_503(secure_group: SecureSentinelGroup, old: str, new: str) -> None:
    url = secure_group.url("bad")
    if old == "&ssl_ca_certs=":  # the CA path is the URL's tail
        url = url.split(old)[0] + new
    else:
        assert old in url
        url = url.replace(old, new)
    store = open_store(url)
    try:
        with pytest.raises(StoreUnavailable) as err:
            await store.ping()
        assert err.value.code is Code.STORE_UNAVAILABLE and err.value.status == 503
    finally:
        await store.close()
