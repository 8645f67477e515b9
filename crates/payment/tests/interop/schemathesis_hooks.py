"""Checks added to schemathesis for the payment service's contract test (tests/openapi_contract.rs).

Loaded with SCHEMATHESIS_HOOKS=schemathesis_hooks (this directory on PYTHONPATH).
"""

import schemathesis

REFUSALS = {503, 504}


@schemathesis.check
def only_refusals_are_5xx(ctx, response, case):
    """No input makes the service fail: a 5xx is only the documented "not now" (503) or
    "the deadline ran out" (504), never a 500 or 502 provoked by a request."""
    if response.status_code >= 500 and response.status_code not in REFUSALS:
        raise AssertionError(
            f"{case.method} {case.path} answered {response.status_code}: {response.text[:300]}"
        )
