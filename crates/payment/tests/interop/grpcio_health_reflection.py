"""Interop: the reference gRPC implementation's health and reflection clients (Python
`grpcio-health-checking`, `grpcio-reflection`) against the payment service's gRPC port.

Run by tests/grpc_health_interop.rs against a live service that requires a bearer key:

    python3 grpcio_health_reflection.py --target HOST:PORT

No stubs are generated and no key is sent: the health stub ships with grpcio-health-checking,
and everything about `payment.v1.Payment` is learnt from the server through reflection, as
grpcurl or Postman would. Exit status 0 means every check held; a failed check raises with a
message naming it.
"""

import argparse


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def health(channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    stub = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "payment.v1.Payment"):
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        check(answer.status == serving, f"Check({service!r}): {answer.status}")
    try:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    except grpc.RpcError as error:
        check(error.code() == grpc.StatusCode.NOT_FOUND, f"unknown service: {error.code()}")
    else:
        raise AssertionError("unknown service: expected NOT_FOUND, the call succeeded")
    print("health: ok")


def reflection(channel):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    database = ProtoReflectionDescriptorDatabase(channel)
    services = set(database.get_services())
    for expected in ("payment.v1.Payment", "grpc.health.v1.Health"):
        check(expected in services, f"{expected} not listed: {sorted(services)}")

    pool = DescriptorPool(database)
    payment = pool.FindServiceByName("payment.v1.Payment")
    charge = payment.FindMethodByName("Charge")
    check(charge is not None, "payment.v1.Payment has no Charge")
    check(charge.full_name == "payment.v1.Payment.Charge", f"method {charge.full_name}")
    check(charge.input_type.full_name == "payment.v1.ChargeRequest",
          f"Charge takes {charge.input_type.full_name}")
    check("order_id" in charge.input_type.fields_by_name, "ChargeRequest has no order_id")
    check(charge.output_type.full_name == "payment.v1.ChargeResponse",
          f"Charge returns {charge.output_type.full_name}")
    print(f"reflection: ok ({', '.join(sorted(services))})")


def main():
    import grpc

    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    args = parser.parse_args()
    with grpc.insecure_channel(args.target) as channel:
        health(channel)
        reflection(channel)


if __name__ == "__main__":
    main()
