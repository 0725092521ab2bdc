"""A scriptable HTTP proxy in front of moto's S3 server, for S3 fault tests.

Each request is shown to ``on_request(req)`` before it goes upstream: returning ``None``
forwards it (after any change the hook made to ``req.body``: a byte flipped in transit),
returning ``(status, code)`` answers it with that S3 error instead. Every request is recorded
in ``seen`` (method, path, headers; bodies are not kept), and every error the upstream server
answered in ``refused`` (the request, the status and the S3 error code).
"""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    path: str  # with the query string
    headers: dict[str, str]  # names lower-cased
    body: bytes = b""
    query: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """``bucket/key`` (path-style addressing, as against moto)."""
        return urlsplit(self.path).path.lstrip("/")

    def has_header(self, *prefixes: str) -> str | None:
        """The first header whose name starts with one of ``prefixes`` (lower-case), or None."""
        return next((h for h in self.headers if h.startswith(prefixes)), None)


Hook = Callable[[Request], "tuple[int, str] | None"]


def error_body(code: str, message: str = "injected", **extra: str) -> bytes:
    more = "".join(f"<{k}>{v}</{k}>" for k, v in extra.items())
    return f"<Error><Code>{code}</Code><Message>{message}</Message>{more}</Error>".encode()


class S3Proxy:
    def __init__(self, upstream: str, on_request: Hook | None = None):
        host, port = upstream.replace("http://", "").split(":")
        self.upstream = (host, int(port))
        self.on_request = on_request or (lambda req: None)
        self.seen: list[Request] = []
        self.refused: list[tuple[Request, int, str]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_a: Any) -> None:
                pass

            def _handle(self) -> None:
                req = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                              self._body(), {k: v[0] for k, v in parse_qs(urlsplit(self.path).query,
                                                                             keep_blank_values=True).items()})
                with proxy.lock:
                    proxy.seen.append(Request(req.method, req.path, req.headers, b"", req.query))
                answer = proxy.on_request(req)
                if answer is not None:
                    status, code = answer
                    self._reply(status, [], b"" if self.command == "HEAD" else error_body(code))
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "content-length", "expect")}
                headers["Content-Length"] = str(len(req.body))
                conn.request(self.command, self.path, body=req.body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if resp.status >= 400:
                    code = re.search(rb"<Code>([^<]*)</Code>", data)
                    with proxy.lock:
                        proxy.refused.append((Request(req.method, req.path, req.headers, b"", req.query),
                                              resp.status, code.group(1).decode() if code else ""))
                kept = [(k, v) for k, v in resp.getheaders()
                        if k.lower() not in ("transfer-encoding", "content-length", "connection")]
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self._reply(resp.status, kept, data, length)
                conn.close()

            def _reply(self, status: int, headers: list, data: bytes, length: str | None = None) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def requests(self, method: str | None = None, key_contains: str = "") -> list[Request]:
        with self.lock:
            return [r for r in self.seen if (method is None or r.method == method) and key_contains in r.key]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
