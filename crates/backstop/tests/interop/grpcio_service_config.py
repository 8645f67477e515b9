"""Sequential unary calls from Python grpcio, retried as a gRPC service config says.

Used by tests/grpc_service_config_interop.rs: it runs the same calls against the same flaky
server through backstop's client stack, built from the same JSON, and compares the attempts
the server saw per logical call.

The method is called with raw bytes (no generated stubs): the server's messages are empty.
Prints one line, "calls=N ok=N unavailable=N".
"""

import argparse
import sys

import grpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True, help="host:port of the server")
    parser.add_argument("--method", required=True, help="full path, e.g. /flaky.Flaky/Call")
    parser.add_argument("--calls", type=int, required=True, help="logical calls, one at a time")
    parser.add_argument("--service-config", required=True, help="the service config JSON")
    args = parser.parse_args()

    options = [
        ("grpc.service_config", args.service_config),
        ("grpc.enable_retries", 1),
        # The config given here is the one used, whatever a resolver might say.
        ("grpc.service_config_disable_resolution", 1),
    ]
    ok = unavailable = 0
    with grpc.insecure_channel(args.target, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        call = channel.unary_unary(args.method)
        for _ in range(args.calls):
            try:
                call(b"", timeout=10)
                ok += 1
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    print(f"unexpected status: {error.code()} {error.details()}", file=sys.stderr)
                    return 1
                unavailable += 1
    print(f"calls={args.calls} ok={ok} unavailable={unavailable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
