"""An upstream for `backstop proxy` tests, written with Python's standard library only.

    python3 upstream.py --events FILE [--port 0] [--workers N]

Prints `listening HOST:PORT` once it accepts connections, then serves HTTP/1.1 (keep-alive)
until killed. Every request appends JSON lines to FILE, one per event, so that a test can see
what reached the upstream and what it did:

- `received`: a request arrived (method, path, the idempotency, effect key and timeout headers,
  the body, how many requests the upstream was serving then, this one included);
- `effect`: a POST executed its effect (once per request, or once per effect key under
  `/dedup/`);
- `deduped`: a POST under `/dedup/` carried an effect key already executed: the stored answer
  is sent again, nothing is executed;
- `cancelled`: the connection was closed while the request was being served (the proxy gave
  up on it).

How a request is served:

- with `--workers N`, at most N requests are served at once, the others wait for a worker
  (a service with a fixed capacity: the wait is part of its latency);
- `X-Upstream-Sleep-Ms: N` makes it take N ms after its effect (watching the connection, so a
  dropped request is seen at once);
- `X-Upstream-Status: N` answers status N instead of 201;
- `X-Upstream-Drop: 1` closes the connection after the effect without answering (the answer
  lost on its way back);
- POST: executes the effect, answers 201 with JSON naming the effect (a new id each time);
- `POST .../big/N`: executes the effect, answers 200 with N bytes of `application/octet-stream`
  (with `Content-Length`; with `?chunked=1`, chunked, its length unknown in advance), written
  1 MiB at a time; `X-Upstream-Break-After: M` closes the connection after M bytes of it
  (an answer that breaks midway);
- GET: answers 200 with JSON echoing the method, path and headers;
- `GET /_effects`: the effect ledger, a JSON array of every `effect` event so far (what
  `backstop chaos --target proxy` reads); not recorded itself.
"""

import argparse
import json
import select
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
EVENTS = None
DONE = {}  # effect key -> (status, body) of /dedup/ effects
COUNTER = [0]
IN_FLIGHT = [0]  # requests being served now
WORKERS = None  # a semaphore with --workers
BLOCK = bytes(range(256)) * 4096  # 1 MiB, what `/big/N` answers are written with


def record(event, **fields):
    fields["event"] = event
    fields["at"] = time.time()
    line = json.dumps(fields, sort_keys=True)
    with LOCK:
        with open(EVENTS, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: the events file is the log
        pass

    def fields(self, body):
        h = self.headers
        return {
            "method": self.command,
            "path": self.path,
            "key": h.get("Idempotency-Key"),
            "effect_key": h.get("Idempotency-Effect-Key"),
            "grpc_timeout": h.get("grpc-timeout"),
            "x_request_timeout": h.get("X-Request-Timeout"),
            "x_forwarded_for": h.get("X-Forwarded-For"),
            "body": body[:4096].decode("utf-8", "replace"),
            "body_len": len(body),
            "in_flight": IN_FLIGHT[0],
        }

    def read_body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def closed(self):
        """Whether the peer closed the connection (nothing more can arrive on it)."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def slow(self, fields):
        """Sleeps as asked, watching the connection; False if the proxy dropped it."""
        ms = int(self.headers.get("X-Upstream-Sleep-Ms") or 0)
        end = time.monotonic() + ms / 1000.0
        while time.monotonic() < end:
            if self.closed():
                record("cancelled", **fields)
                self.close_connection = True
                return False
            time.sleep(0.01)
        return True

    def answer(self, status, payload):
        body = json.dumps(payload, sort_keys=True).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Upstream", "python")
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def do_GET(self):
        if self.path == "/_effects":
            self.ledger()
            return
        self.serving(self.get)

    def ledger(self):
        with LOCK:
            with open(EVENTS, encoding="utf-8") as f:
                lines = f.read().splitlines()
        effects = [e for e in map(json.loads, filter(None, lines)) if e["event"] == "effect"]
        self.answer(200, effects)

    def do_POST(self):
        self.serving(self.post)

    def serving(self, handler):
        """Runs `handler` on a worker (with --workers), counted in IN_FLIGHT while it runs."""
        if WORKERS is not None:
            WORKERS.acquire()
        with LOCK:
            IN_FLIGHT[0] += 1
        try:
            handler()
        finally:
            with LOCK:
                IN_FLIGHT[0] -= 1
            if WORKERS is not None:
                WORKERS.release()

    def get(self):
        body = self.read_body()
        fields = self.fields(body)
        record("received", **fields)
        if not self.slow(fields):
            return
        status = int(self.headers.get("X-Upstream-Status") or 200)
        self.answer(status, {"echo": fields, "headers": dict(self.headers.items())})

    def post(self):
        body = self.read_body()
        fields = self.fields(body)
        record("received", **fields)
        status = int(self.headers.get("X-Upstream-Status") or 201)
        effect_key = fields["effect_key"]
        if self.path.startswith("/dedup/") and effect_key:
            with LOCK:
                done = DONE.get(effect_key)
            if done is not None:
                record("deduped", **fields)
                self.answer(*done)
                return
        with LOCK:
            COUNTER[0] += 1
            n = COUNTER[0]
        payload = {"effect_id": str(uuid.uuid4()), "n": n, "path": self.path}
        record("effect", effect_id=payload["effect_id"], **fields)
        if self.path.startswith("/dedup/") and effect_key:
            with LOCK:
                DONE[effect_key] = (status, payload)
        if not self.slow(fields):
            return
        if self.headers.get("X-Upstream-Drop"):
            self.close_connection = True
            return
        if "/big/" in self.path:
            self.big()
            return
        self.answer(status, payload)

    def big(self):
        """Answers `.../big/N[?chunked=1]`: N bytes, 1 MiB at a time."""
        path, _, query = self.path.partition("?")
        n = int(path.rsplit("/", 1)[1])
        chunked = "chunked=1" in query
        cut = self.headers.get("X-Upstream-Break-After")
        cut = int(cut) if cut is not None else None
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("X-Upstream", "python")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(n))
        self.end_headers()
        left, sent = n, 0
        try:
            while left > 0:
                size = min(left, len(BLOCK))
                if cut is not None and sent + size > cut:
                    size = cut - sent
                data = BLOCK if size == len(BLOCK) else BLOCK[:size]
                if chunked:
                    self.wfile.write(b"%x\r\n" % size + data + b"\r\n")
                else:
                    self.wfile.write(data)
                sent += size
                left -= size
                if cut is not None and sent >= cut:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A proxy killed mid-request resets its connections: expected, not worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def main():
    global EVENTS, WORKERS
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    EVENTS = args.events
    if args.workers > 0:
        WORKERS = threading.BoundedSemaphore(args.workers)
    server = Server(("127.0.0.1", args.port), Handler)
    host, port = server.server_address[:2]
    print(f"listening {host}:{port}", flush=True)
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
