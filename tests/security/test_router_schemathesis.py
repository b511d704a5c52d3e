"""Property-based requests from the router's own OpenAPI document, against real pdgate-sim engines.

The proxy routes are documented with the models the router validates with (`router/validation.py`),
so generated bodies, valid and invalid, exercise the rule and the PD path behind it. Every answer must
be a non-5xx that the document describes. The embedded metaserver's routes are left out here: the
metaserver's own schemathesis test covers them, and a generated registration would add junk engines
that the proxy routes would then (rightly) fail on. A few hundred examples in all.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from tests.integration.router.conftest import Deployment
from tests.support.ports import wait_until

EXAMPLES = {"/v1/completions": 120, "/v1/chat/completions": 120, "/v1/models": 15, "/health": 15, "/metrics": 5}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def pd() -> Iterator[Deployment]:
    with Deployment(api_key=["schema-key"]) as d:
        d.add_many([("prefill", ()), ("decode", ())])
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="a PD pair")
        yield d


def test_no_5xx_and_answers_match_the_schema(pd: Deployment) -> None:
    schema = schemathesis.openapi.from_url(f"{pd.url}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations() if op.ok().path in EXAMPLES]
    assert {op.path for op in operations} == set(EXAMPLES)
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES[operation.path],
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            headers = {"Authorization": "Bearer schema-key"}
            response = case.call(base_url=pd.url, headers=headers, timeout=30)
            case.validate_response(response, checks=CHECKS)

        try:
            run()
        except Exception as exc:  # name the operation: hypothesis' report alone does not
            pytest.fail(f"{operation.method.upper()} {operation.path}: {exc}")
