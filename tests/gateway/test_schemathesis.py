"""Fuzz the served OpenAPI schema with schemathesis over real HTTP: no 5xx, answers match the schema.

Every other check runs: no server error, documented status codes and content types, response
bodies and headers that match the schema. Cases are drawn from each operation's hypothesis strategy directly (schemathesis's pytest
plugin does not run under this pytest version).
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

MAX_EXAMPLES = 40


def served_model(case):
    """Pin the model to the served one: random names would only ever reach the 404 path. A model that
    is not a string at all (a negative case's mutation) stays, to be refused."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "stories260K"
    return case


def test_fuzz_every_operation(open_gateway, capsys):
    schema = schemathesis.openapi.from_url(open_gateway.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    statuses: dict[str, set[int]] = {}
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    # Negative cases (schema-invalid on purpose) exist only for operations that take a body.
    for op, mode in [(op, m) for op in operations for m in modes if op.method == "post" or m == modes[0]]:
        strategy = op.as_strategy(generation_mode=mode)

        @given(case=strategy.map(served_model))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            # positive_data_acceptance is off: schema-valid bodies can still be refused on purpose
            # (token ids past the vocabulary, prompt + max_tokens past the context, an unknown model).
            response = case.call_and_validate(base_url=open_gateway.url, timeout=60,
                                              excluded_checks=[positive_data_acceptance])
            statuses.setdefault(case.operation.path, set()).add(response.status_code)

        run()
    with capsys.disabled():
        print(f"\nschemathesis statuses by path: { {p: sorted(s) for p, s in statuses.items()} }")
    assert all(code < 500 for codes in statuses.values() for code in codes)
    assert 200 in statuses["/v1/completions"] and 200 in statuses["/v1/chat/completions"]
