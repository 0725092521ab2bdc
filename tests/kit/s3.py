"""Tier 2 on moto's S3 server, by hand: a client, the key of a checkpoint file, silent corruption
of a stored object, and ``FaultProxy``, an HTTP proxy that answers 503 to chosen requests."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from core.layout import checkpoint_prefix


def s3_client(settings):
    import boto3

    return boto3.client("s3", endpoint_url=settings.s3_endpoint_url, region_name="us-east-1")


def s3_key(settings, run: str, step: int, rel: str) -> tuple[str, str]:
    """(bucket, key) of a checkpoint file on Tier 2."""
    bucket, _, prefix = settings.tier2_url[len("s3://"):].partition("/")
    return bucket, f"{prefix}/{checkpoint_prefix(run, step)}/{rel}"


def stored_key(settings, run: str, step: int, rel: str) -> tuple[str, str]:
    """(bucket, key) of the object that holds a checkpoint file's bytes on Tier 2: the shared
    content its key points to (``core.storage.s3.shared``), else the file's own key."""
    from core.storage.s3.shared import POINTER_META

    bucket, key = s3_key(settings, run, step, rel)
    content = s3_client(settings).head_object(Bucket=bucket, Key=key).get("Metadata", {}).get(POINTER_META)
    if content is None:
        return bucket, key
    return bucket, f"{settings.tier2_url[len('s3://'):].partition('/')[2]}/{content}"


def corrupt_s3_object(settings, run: str, step: int, rel: str) -> None:
    """Replace the Tier 2 object that holds a checkpoint file's bytes (``stored_key``) with the
    same size but one bit flipped (no checksum sent, as a faulty or foreign writer would)."""
    client = s3_client(settings)
    bucket, key = stored_key(settings, run, step, rel)
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


class FaultProxy:
    """An HTTP proxy to moto's S3 server that answers ``503 SlowDown`` to the next ``fail``
    requests whose method is in ``methods`` (``fail=-1``: every one, until changed)."""

    def __init__(self, upstream: str, *, methods: tuple[str, ...] = ("PUT", "POST")):
        host, port = upstream.replace("http://", "").split(":")
        self.upstream = (host, int(port))
        self.methods = methods
        self.fail = 0
        self.failed = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_a: Any) -> None:
                pass

            def _handle(self) -> None:
                body = self._body()
                if proxy._should_fail(self.command):
                    msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "content-length", "expect")}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _should_fail(self, method: str) -> bool:
        with self.lock:
            if method not in self.methods or self.fail == 0:
                return False
            if self.fail > 0:
                self.fail -= 1
            self.failed += 1
            return True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
