"""An S3 that behaves like S3 for the benchmarks: a shaping proxy on loopback in front of an S3
server (moto's).

moto inverts S3: one GET of a whole object is its fastest read and many ranged GETs in
parallel its slowest, while S3 itself serves each connection at a bounded rate and scales with
connections. Through this proxy every connection's responses are paced to ``--bandwidth``
(per connection, not shared) and each response's first byte waits ``--first-byte`` seconds,
so a reader's time depends on how many connections it keeps busy, as it does against S3.
Defaults follow AWS's published guidance (Optimizing Amazon S3 Performance, "Performance
Guidelines"): about 85-90 MB/s per connection and first-byte-out latencies of roughly 100-200 ms
(the lower end here). Request bodies (uploads) are forwarded unshaped. What the server spends
per request is its own: moto reads the whole object for every ranged GET, which
``benchmarks/moto_ranges.py`` (S3's cost: the range's bytes) takes away.

It counts the GETs of each object and the bytes it sent, so a benchmark can say how often each
object was read from "S3". As a library: ``with S3Shaper(upstream) as proxy: proxy.url``. From
the shell, in front of a running server::

    .venv/bin/python benchmarks/s3_shaper.py --upstream http://127.0.0.1:5000 [--port 0]
        [--bandwidth 90MB/s] [--first-byte 0.1]
"""

from __future__ import annotations

import argparse
import http.client
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import urlsplit

from core.sizing import parse_bandwidth

S3_CONNECTION_BYTES_PER_S = 90e6  # AWS: ~85-90 MB/s per connection
S3_FIRST_BYTE_SECONDS = 0.1  # AWS: first byte out in roughly 100-200 ms
CHUNK = 64 * 1024  # pacing granularity


class Pacer:
    """Paces one stream of bytes to ``rate`` bytes/s: ``sent(n)``, called before n more bytes
    go out, sleeps until the stream's clock has earned them, so no byte arrives sooner than
    the rate allows. Keeps no shared state, so every connection gets its own full rate."""

    def __init__(self, rate: float):
        self.rate = rate
        self.start = time.perf_counter()
        self.done = 0

    def sent(self, n: int) -> None:
        self.done += n
        due = self.start + self.done / self.rate
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


class S3Shaper:
    """The proxy: ``url`` to point an S3 client at; ``gets`` counts GETs per ``bucket/key`` and
    ``get_bytes`` the body bytes those GETs were sent; ``bytes_sent`` the response bytes it sent.
    Stop with ``close()`` or use as a context."""

    def __init__(self, upstream: str, *, bandwidth: float = S3_CONNECTION_BYTES_PER_S,
                 first_byte: float = S3_FIRST_BYTE_SECONDS, port: int = 0):
        if bandwidth <= 0 or first_byte < 0:
            raise ValueError("bandwidth must be positive and first_byte not negative")
        up = urlsplit(upstream)
        self.upstream = (up.hostname or "127.0.0.1", up.port or 80)
        self.bandwidth, self.first_byte = bandwidth, first_byte
        self.gets: Counter[str] = Counter()
        self.get_bytes: Counter[str] = Counter()
        self.get_times: list[tuple[float, str]] = []  # (time.time(), key) of each GET as it arrived
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int:
        """The native id of the thread that accepts connections (each connection's thread is
        started by it, so it has its CPU affinity)."""
        assert self._thread.native_id is not None
        return self._thread.native_id

    def reset_counts(self) -> None:
        with self._lock:
            self.gets.clear()
            self.get_bytes.clear()
            self.get_times.clear()
            self.bytes_sent = 0

    def _count_get(self, key: str) -> None:
        with self._lock:
            self.gets[key] += 1
            self.get_times.append((time.time(), key))

    def _count_bytes(self, n: int, key: str | None) -> None:
        with self._lock:
            self.bytes_sent += n
            if key is not None:
                self.get_bytes[key] += n

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: one pacer per request on a kept connection

            def log_message(self, *_a: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "content-length", "expect", "connection")}
                headers["Content-Length"] = str(len(body))
                key = urlsplit(self.path).path.lstrip("/") if self.command == "GET" else None
                if key is not None:  # counted before any byte goes: a client that has read the
                    proxy._count_get(key)  # whole answer always finds its GET counted
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    resp = upstream.getresponse()
                    whole = None  # a chunked answer is read whole, to send it with a length
                    if resp.getheader("Content-Length") is None and self.command != "HEAD":
                        whole = resp.read()
                    time.sleep(proxy.first_byte)
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length") or whole is None:
                            self.send_header(k, v)
                    if whole is not None:
                        self.send_header("Content-Length", str(len(whole)))
                    elif resp.getheader("Content-Length") is None:
                        self.send_header("Content-Length", "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self._stream(resp, whole, key if 200 <= resp.status < 300 else None)
                finally:
                    upstream.close()

            def _stream(self, resp: http.client.HTTPResponse, whole: bytes | None, key: str | None) -> int:
                pacer = Pacer(proxy.bandwidth)
                chunks = (iter(lambda: resp.read(CHUNK), b"") if whole is None
                          else (whole[i:i + CHUNK] for i in range(0, len(whole), CHUNK)))
                for chunk in chunks:
                    pacer.sent(len(chunk))
                    proxy._count_bytes(len(chunk), key)  # before the write, as the GET: never behind the client
                    self.wfile.write(chunk)
                return pacer.done

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="the S3 server to shape, e.g. http://127.0.0.1:5000")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    ap.add_argument("--bandwidth", default="90MB/s", help="per-connection response bandwidth")
    ap.add_argument("--first-byte", type=float, default=S3_FIRST_BYTE_SECONDS, help="seconds before each "
                    "response's first byte")
    args = ap.parse_args(argv)
    with S3Shaper(args.upstream, bandwidth=parse_bandwidth(args.bandwidth), first_byte=args.first_byte,
                  port=args.port) as proxy:
        print(f"shaping {args.upstream} at {proxy.url}: {args.bandwidth} per connection, "
              f"{args.first_byte * 1000:.0f} ms to first byte; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
