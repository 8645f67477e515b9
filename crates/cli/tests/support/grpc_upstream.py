"""A gRPC upstream and client for `backstop proxy` tests, on Python grpcio (h2c).

    python3 grpc_upstream.py serve --events FILE
    python3 grpc_upstream.py call --target HOST:PORT --key KEY --count N --payload HEX
    python3 grpc_upstream.py watch --target HOST:PORT

`serve` prints `listening HOST:PORT`, then serves, with raw bytes as messages (no generated
code):

- `/shop.v1.Orders/Create` (unary): appends a `received` and an `effect` JSON line to FILE
  (metadata `idempotency-key` and `idempotency-effect-key`, the budget left), sleeps for the
  metadata `x-upstream-sleep-ms`, answers `order:<n>:<payload hex>`;
- `/shop.v1.Orders/Watch` (server streaming): answers three messages.

`call` sends COUNT concurrent `Create` calls with the same key and payload and prints one JSON
list of their results (`response` hex and `replayed`, or the `code` and `details` of a
failure). `watch` prints the `Watch` stream's messages as a JSON list.
"""

import argparse
import json
import sys
import threading
import time
from concurrent import futures

import grpc

LOCK = threading.Lock()
COUNTER = [0]


def serve(events):
    def record(event, **fields):
        fields["event"] = event
        with LOCK:
            with open(events, "a", encoding="utf-8") as f:
                f.write(json.dumps(fields, sort_keys=True) + "\n")

    def create(request, context):
        md = dict(context.invocation_metadata())
        fields = {
            "path": "/shop.v1.Orders/Create",
            "key": md.get("idempotency-key"),
            "effect_key": md.get("idempotency-effect-key"),
            "time_remaining": context.time_remaining(),
            "body": request.hex(),
        }
        record("received", **fields)
        with LOCK:
            COUNTER[0] += 1
            n = COUNTER[0]
        record("effect", **fields)
        time.sleep(int(md.get("x-upstream-sleep-ms") or 0) / 1000.0)
        return f"order:{n}:{request.hex()}".encode()

    def watch(request, context):
        for i in range(3):
            yield f"update:{i}".encode()

    handler = grpc.method_handlers_generic_handler(
        "shop.v1.Orders",
        {
            "Create": grpc.unary_unary_rpc_method_handler(create),
            "Watch": grpc.unary_stream_rpc_method_handler(watch),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def call(target, key, count, payload):
    channel = grpc.insecure_channel(target)
    create = channel.unary_unary("/shop.v1.Orders/Create")

    def one(_):
        try:
            response, rpc = create.with_call(
                payload,
                metadata=[("idempotency-key", key), ("x-upstream-sleep-ms", "300")],
                timeout=20,
            )
            replayed = dict(rpc.initial_metadata()).get("idempotent-replayed") == "true"
            return {"response": response.hex(), "replayed": replayed}
        except grpc.RpcError as e:
            return {"code": e.code().name, "details": e.details()}

    with futures.ThreadPoolExecutor(max_workers=count) as pool:
        results = list(pool.map(one, range(count)))
    print(json.dumps(results))


def watch(target):
    channel = grpc.insecure_channel(target)
    stream = channel.unary_stream("/shop.v1.Orders/Watch")
    print(json.dumps([m.decode() for m in stream(b"", timeout=20)]))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--events", required=True)
    c = sub.add_parser("call")
    c.add_argument("--target", required=True)
    c.add_argument("--key", required=True)
    c.add_argument("--count", type=int, default=1)
    c.add_argument("--payload", default="")
    w = sub.add_parser("watch")
    w.add_argument("--target", required=True)
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.events)
    elif args.mode == "call":
        call(args.target, args.key, args.count, bytes.fromhex(args.payload))
    else:
        watch(args.target)


if __name__ == "__main__":
    sys.exit(main())
