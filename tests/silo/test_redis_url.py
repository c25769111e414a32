"""Credentials in Redis URLs: one rule finds them for the parser and for ``redact``.

(URL forms and options are tested in tests/silo/cluster/test_sentinel.py.)
"""

from __future__ import annotations

from urllib.parse import urlsplit

from hypothesis import given
from hypothesis import strategies as st

from silo.redis_url import parse_redis_url, redact

FORMS = (
    "redis://u:{pw}@h1:6380/0",
    "rediss://u:{pw}@h1:6380/2?wait_replicas=1",
    "redis+cluster://u:{pw}@h1:7000,h2:7001?wait_replicas=1",
    "redis+sentinel://u:{pw}@h1:26380,h2/svc/1",
)


def _hosts(url: str) -> object:
    t = parse_redis_url(url)
    if t.cluster is not None:
        return t.cluster.nodes
    if t.sentinel is not None:
        return t.sentinel.sentinels, t.sentinel.service, t.sentinel.db
    assert t.direct_url is not None
    parts = urlsplit(t.direct_url)
    return parts.hostname, parts.port, parts.path


def _password(url: str) -> str | None:
    t = parse_redis_url(url)
    if t.cluster is not None:
        return t.cluster.password
    if t.sentinel is not None:
        return t.sentinel.password
    assert t.direct_url is not None
    return urlsplit(t.direct_url).password


@given(pw=st.text(), form=st.sampled_from(FORMS))
def test_a_redacted_url_holds_no_part_of_any_password_and_names_the_parsed_hosts(pw: str, form: str) -> None:
    url = form.format(pw=pw)
    shown = redact(url)
    # What the redacted URL may hold besides the marker: the URL's own text, without the password.
    rest = form.format(pw="")
    visible = shown.replace("***", "", 1)
    for i in range(len(pw) - 2):
        tail = pw[i:]
        assert tail in rest or tail not in visible, f"{tail!r} of the password shows in {shown!r}"
    # The parser and redact split at the same '@': the hosts they name are the same ...
    assert _hosts(shown) == _hosts(url) == _hosts(rest)
    # ... and the password the client sends is the whole one (percent-escapes decoded).
    assert _password(url) is not None


def test_a_password_with_an_at_sign_is_hidden_whole() -> None:
    assert redact("redis://u:p@ss@word@h:1/0") == "redis://u:***@h:1/0"
    assert parse_redis_url("redis+cluster://u:p@ss@h:1").cluster.nodes == (("h", 1),)  # type: ignore[union-attr]
    t = parse_redis_url("redis://u:p@ss/w?rd@h:1/0")
    assert t.direct_url is not None
    parts = urlsplit(t.direct_url)
    assert (parts.hostname, parts.port, parts.password) == ("h", 1, "p%40ss%2Fw%3Frd")


def test_a_password_in_the_query_is_hidden_too() -> None:
    assert redact("unix:///tmp/r.sock?db=0&password=s3cret") == "unix:///tmp/r.sock?db=0&password=***"
    assert (
        redact("redis+sentinel://h:1/s?sentinel_password=s3cret&wait_replicas=1")
        == "redis+sentinel://h:1/s?sentinel_password=***&wait_replicas=1"
    )
