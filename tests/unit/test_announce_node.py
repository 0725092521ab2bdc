"""A stager whose node no agent serves says so once, loudly (off the training thread), instead of
committing checkpoints nobody promotes; ``ckpt up`` prints what a job in another shell needs."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import numpy as np
import pytest

from ckpt.client import CheckpointStager
from ckpt.local_stack import exports_text, job_exports, stack_env


class _FakePrefect(BaseHTTPRequestHandler):
    served: ClassVar[set[str]] = {"/api/deployments/name/promote-checkpoint/node-0"}
    asked: ClassVar[list[str]] = []

    def do_GET(self):
        self.asked.append(self.path)
        self.send_response(200 if self.path in self.served else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def api():
    server = HTTPServer(("127.0.0.1", 0), _FakePrefect)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    _FakePrefect.asked = []
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()
    server.server_close()


def _save_twice(settings):
    with CheckpointStager("run-n", settings=settings) as stager:
        for step in (1, 2):
            stager.save(step, {"w": np.ones(4, dtype=np.float32)})


@pytest.mark.parametrize("node,warned", [("gpu-host-17", True), ("node-0", False)])
def test_an_unserved_node_is_named_once_with_the_fix(settings_factory, api, caplog, node, warned):
    settings = settings_factory(node=node, prefect_api_url=api, catalog_url="sqlite:///" + "/nonexistent/x.db")
    with caplog.at_level(logging.WARNING, logger="ckpt.announce"):
        _save_twice(settings)
    lines = [r.getMessage() for r in caplog.records if "NO AGENT SERVES NODE" in r.getMessage()]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert "gpu-host-17" in lines[0] and "CKPT_NODE" in lines[0]
        assert "ckpt agent --node gpu-host-17 --node-only" in lines[0]  # not a second cluster agent
    assert len([p for p in _FakePrefect.asked if "/deployments/name/" in p]) == 1  # asked once


def test_up_exports_name_the_node_catalog_credentials_and_endpoint(tmp_path):
    env = stack_env(tmp_path, api_url="http://127.0.0.1:4200/api", s3_url="http://127.0.0.1:5000")
    out = job_exports(env, node="node-0", catalog_url=f"sqlite:///{tmp_path}/catalog.db")
    for key in ("CKPT_NODE", "CKPT_CATALOG_URL", "PREFECT_API_URL", "CKPT_S3_ENDPOINT_URL", "CKPT_TIER2_URL",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        assert out[key], key
    assert out["CKPT_NODE"] == "node-0" and out["CKPT_S3_ENDPOINT_URL"] == "http://127.0.0.1:5000"


def test_up_with_two_nodes_prints_the_exports_of_each_node(tmp_path):
    env = stack_env(tmp_path, api_url="http://127.0.0.1:4200/api", s3_url="http://127.0.0.1:5000")
    catalog = f"sqlite:///{tmp_path}/catalog.db"
    per_node = {n: job_exports(env, node=n, catalog_url=catalog) for n in ("node-0", "node-1")}
    text = "\n".join(exports_text(per_node))
    assert "on node-0: export CKPT_NODE=node-0" in text and "on node-1: export CKPT_NODE=node-1" in text
    assert text.count("export PREFECT_API_URL=") == 1  # what the shells share, once
    assert "export CKPT_CATALOG_URL=" in text and "export AWS_SECRET_ACCESS_KEY=" in text
