"""A connection URL in a message (an error, a log line, anything Prefect stores) shows no
secret, whatever characters the password holds."""

import pytest

from core.settings import redact_url


@pytest.mark.parametrize("text, shown", [
    ("postgresql+psycopg://user:secret@host:5432/db", "postgresql+psycopg://user:***@host:5432/db"),
    ("postgresql://u:pa/ss@h/db", "postgresql://u:***@h/db"),  # a "/" in the password
    ("error connecting to postgresql://u:p@ss@h/db: refused", "error connecting to postgresql://u:***@h/db: refused"),
    ("invalid catalog URL 'postgresql://a:b#c@h:5/d': bad", "invalid catalog URL 'postgresql://a:***@h:5/d': bad"),
    ("https://TOKEN@host/p", "https://***@host/p"),  # a bare token
    ("user:pw@host/x", "user:***@host/x"),  # no scheme
])
def test_the_secret_is_gone_and_the_rest_stays(text, shown):
    assert redact_url(text) == shown


@pytest.mark.parametrize("text", ["sqlite:////tmp/catalog.db", "file:///home/a@b.com/ckpt", "s3://bucket/prefix",
                                  "no URL here"])
def test_a_url_without_a_secret_is_left_as_it_is(text):
    assert redact_url(text) == text
