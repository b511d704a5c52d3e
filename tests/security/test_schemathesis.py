"""Point: property-based requests from the metaserver's own OpenAPI document, on both stores.

Every operation gets generated inputs (valid and invalid) over a real socket, with the admin token so
the writes run too; every answer must be a non-5xx that the document describes (status, content type,
body schema, Allow on 405). A few hundred examples in all, so it runs with the unit tests.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.security.conftest import AUTH, TOKEN, Serve

EXAMPLES_PER_OPERATION = 12  # x ~14 operations x 2 stores: a few hundred requests in all
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def _seed(base: str) -> list[str]:
    """Real records for generated requests to hit: instance p0, and handoffs in PENDING and READY.
    Random ids alone would only ever meet 404s, and the writes would never move a record."""
    with httpx.Client(base_url=base, headers=AUTH) as http:
        reg = {"id": "p0", "role": "both", "url": "http://10.0.0.5:8100", "model": "m"}
        assert http.post("/v1/instances", json=reg).status_code == 200
        tids = [http.post("/v1/handoffs", json={"prefill_instance_id": "p0"}).json()["transfer_id"] for _ in range(6)]
        for tid in tids[3:]:
            assert http.put(f"/v1/handoffs/{tid}/ready", json={"block_ids": [[1]], "num_tokens": 8}).status_code == 200
    return tids


def test_no_5xx_and_answers_match_the_schema(serve: Serve) -> None:
    base = serve(admin_token=TOKEN, max_wait_s=0.2).url
    tids = _seed(base)
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:

        @given(
            case=operation.as_strategy(),
            authorized=st.sampled_from([True, True, True, False]),
            known=st.booleans(),
            pick=st.integers(0, len(tids) - 1),
        )
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case, authorized: bool, known: bool, pick: int) -> None:
            if known:  # half the cases aim at live records (and a valid engine URL) instead of random ones
                params = case.path_parameters or {}
                if "transfer_id" in params:
                    params["transfer_id"] = tids[pick]
                if "instance_id" in params:
                    params["instance_id"] = "p0"
                if case.operation.path == "/v1/instances" and isinstance(case.body, dict):
                    case.body["url"] = "http://10.0.0.6:8100"
            headers = dict(AUTH) if authorized else {}
            response = case.call(base_url=base, headers=headers, timeout=10)
            case.validate_response(response, checks=CHECKS)

        try:
            run()
        except Exception as exc:  # name the operation: hypothesis' report alone does not
            pytest.fail(f"{operation.method.upper()} {operation.path}: {exc}")
