"""benchmarks/moto_ranges.py: moto serving a ranged GET from the range's bytes gives the same
answers as moto itself (bytes, status, Content-Range, 416), and reads no whole object for it."""

from __future__ import annotations

import os

import boto3
import pytest
from botocore.exceptions import ClientError

from benchmarks import moto_ranges
from ckpt.processes import LOOPBACK, free_port

SIZE = 3 * 1024 * 1024 + 17


@pytest.fixture(scope="module")
def server():
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    s = ThreadedMotoServer(ip_address=LOOPBACK, port=free_port(), verbose=False)
    s.start()
    host, port = s.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
    client.create_bucket(Bucket="ranges")
    data = os.urandom(SIZE)
    client.put_object(Bucket="ranges", Key="obj", Body=data)
    try:
        yield client, data
    finally:
        s.stop()


@pytest.fixture()
def whole_reads(monkeypatch):
    """moto_ranges patched in (this process runs the server's handlers); counts the GETs that
    read the whole object and the slices read on their own."""
    count = {"whole": 0, "slices": 0}
    whole, piece = moto_ranges._whole, moto_ranges._Lazy.__getitem__

    def counting(key):
        count["whole"] += 1
        return whole(key)

    def slice_counting(self, item):
        count["slices"] += 1
        return piece(self, item)

    monkeypatch.setattr(moto_ranges, "_whole", counting)
    monkeypatch.setattr(moto_ranges._Lazy, "__getitem__", slice_counting)
    with moto_ranges.patched():
        yield count


@pytest.mark.parametrize("begin,end", [(0, 0), (0, 8191), (1024 * 1024, 2 * 1024 * 1024 - 1), (SIZE - 1, SIZE - 1),
                                       (SIZE - 100, SIZE + 5000), (5, None)])
def test_a_range_comes_from_its_own_bytes(server, whole_reads, begin, end):
    client, data = server
    want = data[begin:(SIZE if end is None else end + 1)]
    got = client.get_object(Bucket="ranges", Key="obj", Range=f"bytes={begin}-{'' if end is None else end}")
    assert got["Body"].read() == want
    last = begin + len(want) - 1
    assert got["ContentRange"] == f"bytes {begin}-{last}/{SIZE}"
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert whole_reads == {"whole": 0, "slices": 1}  # the range read alone, not the whole object


def test_other_gets_are_moto_s_own(server, whole_reads):
    client, data = server
    assert client.get_object(Bucket="ranges", Key="obj")["Body"].read() == data
    assert client.get_object(Bucket="ranges", Key="obj", Range="bytes=-10")["Body"].read() == data[-10:]
    assert whole_reads == {"whole": 2, "slices": 0}
    with pytest.raises(ClientError) as err:  # a range past the end: 416, as moto and S3 answer it
        client.get_object(Bucket="ranges", Key="obj", Range=f"bytes={SIZE}-{SIZE + 10}")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 416


def test_the_benchmarks_start_it_as_a_server(tmp_path):
    """``s3_bucket(..., ranges_at_cost=True)``, as cluster_restore.py starts its S3: the script
    runs as moto's server and answers ranged GETs."""
    from benchmarks.common import s3_bucket

    data = os.urandom(SIZE)
    with s3_bucket(None, tmp_path / "moto.log", ranges_at_cost=True) as (endpoint, bucket):
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.put_object(Bucket=bucket, Key="obj", Body=data)
        got = client.get_object(Bucket=bucket, Key="obj", Range="bytes=1000-1999")
        assert got["Body"].read() == data[1000:2000]
    assert "moto_ranges: each ranged GET is served from the range's bytes" in (tmp_path / "moto.log").read_text()
