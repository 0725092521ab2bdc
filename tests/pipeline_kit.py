"""Helpers for the pipeline tests: real safetensors checkpoints on Tier 0, settings wired to a
real catalog (SQLite or PostgreSQL) and, when asked, moto's S3 server as Tier 2; a recorder
of the events the pipeline announces; a small fault-injecting HTTP proxy in front of moto.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from core.manifest import Manifest
from core.layout import checkpoint_dirname
from datetime import UTC


def write_checkpoint(tier0_root: Path | str, run: str, step: int, *, shards: int = 2, shard_bytes: int = 1 << 20,
                     kind: str = "step", part: int = 0, parts: int = 1, node: str = "node-0",
                     metrics: dict[str, float] | None = None, tags: dict[str, str] | None = None,
                     seed: int = 0) -> Manifest:
    """A Hugging Face sharded safetensors checkpoint (part) committed on Tier 0 with its manifest."""
    from safetensors.numpy import save_file

    from core.manifest_build import build_manifest, write_manifest

    folder = Path(tier0_root) / run / checkpoint_dirname(step)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed * 1_000_003 + step * 101 + part)
    weight_map = {}
    for i in range(shards):
        name = (f"model-p{part:02d}-{i:05d}.safetensors" if parts > 1
                else f"model-{i + 1:05d}-of-{shards:05d}.safetensors")
        tensor = f"layer{part}.{i}.weight"
        save_file({tensor: rng.standard_normal(shard_bytes // 4, dtype=np.float32)}, str(folder / name))
        weight_map[tensor] = name
    if parts > 1 and part == 0:  # rank 0 writes the index of every part's shards
        weight_map = {f"layer{p}.{i}.weight": f"model-p{p:02d}-{i:05d}.safetensors"
                      for p in range(parts) for i in range(shards)}
    if part == 0:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": parts * shards * shard_bytes}, "weight_map": weight_map}))
    m = build_manifest(folder, run, step, part=part, parts=parts, node=node, kind=kind, metrics=metrics,
                       tags=tags, fmt="hf-sharded")
    write_manifest(folder, m)
    return m


def pipeline_settings(settings_factory, db_url: str, *, runs: tuple[str, ...] = ("run-a",), **overrides: Any):
    """Settings on a fresh, migrated catalog at ``db_url`` with ``runs`` registered; no retries
    delays (tests that exercise retries set their own)."""
    from db.catalog import Catalog, upgrade

    overrides.setdefault("task_retries", 0)
    overrides.setdefault("copy_parallelism", 2)
    settings = settings_factory(catalog_url=db_url, **overrides)
    upgrade(db_url)
    cat = Catalog(db_url)
    try:
        for run in runs:
            cat.ensure_run(run, actor="test")
    finally:
        cat.close()
    return settings


def catalog(settings):
    """A catalog on the settings' URL (close it, or use it in a ``with closing(...)``)."""
    from db.catalog import Catalog

    return Catalog(settings.catalog_url)


def replica_states(settings, run: str, step: int) -> dict[tuple[int, int], str]:
    """{(tier, part): state} of a checkpoint's replicas (Tier 0 of every node folded)."""
    cat = catalog(settings)
    try:
        ck = cat.get_checkpoint(run, step)
        return {(r.tier, r.part): r.state for r in cat.replicas(ck.id)}
    finally:
        cat.close()


def ckpt_dir(root: Path | str, run: str, step: int) -> Path:
    return Path(root) / run / checkpoint_dirname(step)


def shard_paths(root: Path | str, run: str, step: int) -> list[Path]:
    return sorted(ckpt_dir(root, run, step).glob("*.safetensors"))


def flip_bit(path: Path, offset: int | None = None) -> None:
    """Flip one bit in the middle of the tensor data (not the header): same size, wrong bytes."""
    size = path.stat().st_size
    pos = size - size // 3 if offset is None else offset
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x10]))


def truncate(path: Path, keep: float = 0.5) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(int(path.stat().st_size * keep))


def same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def published_files(root: Path | str, run: str, step: int) -> list[str]:
    """Relative paths under a checkpoint folder, staging files included (they must not linger)."""
    d = ckpt_dir(root, run, step)
    if not d.exists():
        return []
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


@dataclass
class Recorder:
    """An announcer (``core.events.announcing``) that records what the pipeline announces: (event, run, step, part, extra)."""

    seen: list[tuple[str, str, int, int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, name: str, run: str, step: int, *, part: int = 0, parts: int = 1, node: str = "",
                 payload: dict[str, Any] | None = None, extra_id: str = "", **_: Any) -> bool:
        with self.lock:
            self.seen.append((name, run, step, part, extra_id))
        return True

    def names(self) -> list[str]:
        return [s[0].rsplit(".", 1)[-1] for s in self.seen]


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


def expire_claims(settings) -> int:
    """Make every live claim's lease lapse now, as if its worker died a lease ago (tests never
    wait on a wall clock for a lease to run out); returns how many were expired."""
    from datetime import datetime, timedelta

    from sqlalchemy import update

    from db.models import Replica

    replicas = Replica.__table__

    cat = catalog(settings)
    try:
        past = datetime.now(UTC) - timedelta(days=1)
        with cat.engine.begin() as conn:
            return conn.execute(update(replicas).where(replicas.c.lease_expires_at.is_not(None))
                                .values(lease_expires_at=past)).rowcount
    finally:
        cat.close()
