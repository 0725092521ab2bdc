"""The benchmarks' S3 shaping proxy caps each connection's bandwidth (not the proxy's total),
delays each response's first byte, passes bytes through unchanged and counts GETs per object."""

from __future__ import annotations

import http.client
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.s3_shaper import S3Shaper

BODY = bytes(range(256)) * 2048  # 512 KiB


@pytest.fixture(scope="module")
def upstream():
    """A plain HTTP server answering every GET with BODY, as fast as loopback goes."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _get(url: str, path: str) -> tuple[bytes, float, float]:
    """(body, seconds to the status line, seconds in all) of one GET on a new connection."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    t0 = time.perf_counter()
    conn.request("GET", path)
    resp = conn.getresponse()
    first = time.perf_counter() - t0
    data = resp.read()
    conn.close()
    return data, first, time.perf_counter() - t0


def test_one_connection_is_capped_and_waits_for_its_first_byte(upstream):
    with S3Shaper(upstream, bandwidth=1e6, first_byte=0.2) as proxy:
        data, first, total = _get(proxy.url, "/bucket/key")
    assert data == BODY
    assert first >= 0.2
    assert total >= 0.2 + len(BODY) / 1e6 * 0.95  # 524 KB at 1 MB/s: at least half a second
    direct = _get(upstream, "/bucket/key")[2]
    assert direct < total


def test_the_cap_is_per_connection_not_shared(upstream):
    """Four connections at once each get the full rate: together they take about as long as
    one, not four times as long (which a shared cap would give: >= 2.1 s)."""
    with S3Shaper(upstream, bandwidth=1e6, first_byte=0.0) as proxy:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: _get(proxy.url, f"/bucket/obj-{i % 2}"), range(4)))
        wall = time.perf_counter() - t0
        gets, sent, per_key = dict(proxy.gets), proxy.bytes_sent, dict(proxy.get_bytes)
    assert all(r[0] == BODY for r in results)
    assert all(r[2] >= len(BODY) / 1e6 * 0.95 for r in results)
    assert wall < 4 * len(BODY) / 1e6 * 0.75
    assert gets == {"bucket/obj-0": 2, "bucket/obj-1": 2}
    assert sent == 4 * len(BODY)
    assert per_key == {"bucket/obj-0": 2 * len(BODY), "bucket/obj-1": 2 * len(BODY)}


def test_boto3_reads_through_it_from_moto(s3_endpoint, s3_bucket):
    import boto3

    blob = bytes(range(256)) * 4096  # 1 MiB
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").put_object(
        Bucket=s3_bucket, Key="a/b", Body=blob)
    with S3Shaper(s3_endpoint, bandwidth=20e6, first_byte=0.01) as proxy:
        c = boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1")
        assert c.get_object(Bucket=s3_bucket, Key="a/b")["Body"].read() == blob
        part = c.get_object(Bucket=s3_bucket, Key="a/b", Range="bytes=10-19")["Body"].read()
        assert part == blob[10:20]
        assert c.head_object(Bucket=s3_bucket, Key="a/b")["ContentLength"] == len(blob)
        assert proxy.gets[f"{s3_bucket}/a/b"] == 2
        assert proxy.get_bytes[f"{s3_bucket}/a/b"] == len(blob) + 10  # the HEAD sends no body


def test_bad_settings_are_refused(upstream):
    with pytest.raises(ValueError):
        S3Shaper(upstream, bandwidth=0)
