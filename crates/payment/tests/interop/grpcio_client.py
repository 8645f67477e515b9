"""Interop: the reference gRPC implementation (Python grpcio) against `payment.v1.Payment`.

Run by tests/grpc_interop.rs against a live service:

    python3 grpcio_client.py --proto-root PROTO_DIR --target HOST:PORT basic
    python3 grpcio_client.py --proto-root PROTO_DIR --target HOST:PORT retry --key K --order O

The stubs are generated at run time from the .proto with grpcio-tools, so the test always
speaks the contract in the repository. Exit status 0 means every check held; a failed check
raises with a message naming it.
"""

import argparse
import json
import sys
import tempfile
import time


def generate_stubs(proto_root, out_dir):
    from grpc_tools import protoc
    import grpc_tools

    include = grpc_tools.__path__[0] + "/_proto"
    code = protoc.main([
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"{proto_root}/payment/v1/payment.proto",
    ])
    if code != 0:
        raise SystemExit(f"protoc failed with {code}")
    sys.path.insert(0, out_dir)


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def expect_error(call, code, what):
    import grpc

    try:
        call()
    except grpc.RpcError as error:
        check(error.code() == code, f"{what}: expected {code}, got {error.code()} {error.details()!r}")
        return error
    raise AssertionError(f"{what}: expected {code}, the call succeeded")


def metadata(pairs):
    return {k: v for k, v in (pairs or ())}


def basic(stub, pb2):
    import grpc

    key = [("idempotency-key", "py-key-1")]
    request = pb2.ChargeRequest(order_id="py-order-1", amount_cents=1999, currency="EUR")

    # Charge with a deadline and metadata.
    first, call = stub.Charge.with_call(request, timeout=5, metadata=key)
    check(first.status == "succeeded", f"charge status {first.status!r}")
    check(first.amount_cents == 1999, "amount")
    check(first.intent_id and first.charge_id, "ids")
    check("idempotent-replayed" not in metadata(call.initial_metadata()), "first call is not a replay")

    # The same key again: the stored answer, marked as a replay.
    again, call = stub.Charge.with_call(request, timeout=5, metadata=key)
    check(again == first, "the replay equals the original answer")
    check(metadata(call.initial_metadata()).get("idempotent-replayed") == "true",
          f"replay metadata {call.initial_metadata()!r}")

    # GetCharge converges on the same payment.
    got = stub.GetCharge(pb2.GetChargeRequest(intent_id=first.intent_id), timeout=5)
    check(got == first, "GetCharge returns the payment")

    # The status mapping, as grpcio sees it.
    expect_error(lambda: stub.Charge(request, timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "missing key")
    expect_error(
        lambda: stub.Charge(pb2.ChargeRequest(order_id="py-order-1", amount_cents=1, currency="EUR"),
                            timeout=5, metadata=key),
        grpc.StatusCode.FAILED_PRECONDITION, "key reused with other parameters")
    expect_error(lambda: stub.Charge(request, timeout=5, metadata=[("idempotency-key", "py-key-2")]),
                 grpc.StatusCode.ALREADY_EXISTS, "same order, other key")
    expect_error(
        lambda: stub.Charge(pb2.ChargeRequest(order_id="py-order-3", amount_cents=0),
                            timeout=5, metadata=[("idempotency-key", "py-key-3")]),
        grpc.StatusCode.INVALID_ARGUMENT, "invalid amount")
    expect_error(lambda: stub.GetCharge(pb2.GetChargeRequest(intent_id="nope"), timeout=5),
                 grpc.StatusCode.NOT_FOUND, "unknown intent")
    print("basic: ok")


def retry(stub, pb2, key, order):
    """Another attempt holds `key`: the server answers ABORTED with grpc-retry-pushback-ms.
    grpcio's retryPolicy backs off 10-20 ms between its 5 attempts, which would spend them all
    while the first attempt still runs; only by waiting the server's pushback does the call
    end with the stored answer."""
    request = pb2.ChargeRequest(order_id=order, amount_cents=700)
    started = time.monotonic()
    response, call = stub.Charge.with_call(request, timeout=20, metadata=[("idempotency-key", key)])
    elapsed = time.monotonic() - started
    check(response.status == "succeeded", f"status {response.status!r}")
    check(metadata(call.initial_metadata()).get("idempotent-replayed") == "true",
          "the retried call got the first attempt's stored answer")
    print(f"retry: ok after {elapsed:.2f}s")


RETRY_SERVICE_CONFIG = {
    "methodConfig": [{
        "name": [{"service": "payment.v1.Payment"}],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.01s",
            "maxBackoff": "0.02s",
            "backoffMultiplier": 1.0,
            "retryableStatusCodes": ["ABORTED", "UNAVAILABLE"],
        },
    }]
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--proto-root", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("phase", choices=["basic", "retry"])
    parser.add_argument("--key")
    parser.add_argument("--order")
    args = parser.parse_args()

    import grpc

    with tempfile.TemporaryDirectory() as out:
        generate_stubs(args.proto_root, out)
        from payment.v1 import payment_pb2 as pb2
        from payment.v1 import payment_pb2_grpc as pb2_grpc

        options = [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(RETRY_SERVICE_CONFIG)),
        ]
        with grpc.insecure_channel(args.target, options=options) as channel:
            stub = pb2_grpc.PaymentStub(channel)
            if args.phase == "basic":
                basic(stub, pb2)
            else:
                retry(stub, pb2, args.key, args.order)


if __name__ == "__main__":
    main()
