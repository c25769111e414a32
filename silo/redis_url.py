"""Redis URLs: a plain server, or a Sentinel-managed master; what to wait for after writes.

Every Redis URL redgrain takes (silo, client, dashboard, CLI) is parsed here
and nowhere else (``silo/redis_util.py`` turns the result into clients):

- ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS), ``unix://...``:
  one server, handed to redis-py's own ``from_url`` (its query options such as
  ``ssl_ca_certs`` work as they always did).
- ``redis+sentinel://[user:pass@]h1:p1[,h2:p2...]/service[/db]`` and
  ``rediss+sentinel://...`` (TLS to the sentinels and to the data nodes): the
  master of ``service`` as the sentinels name it, found again after a failover.
  This is the form celery, kombu and ``redis-sentinel-url`` use; the port
  defaults to 26379. The user and password are the data nodes' (Sentinel
  deployments use one ``requirepass`` for masters and replicas);
  ``?sentinel_username=&sentinel_password=`` authenticate to the sentinels
  when they need it.
- ``redis+cluster://[user:pass@]h1:p1[,h2:p2...][?options]`` (and
  ``rediss+cluster://`` for TLS; ``redis-cluster://`` is accepted too): a
  Redis Cluster, reached through any of the listed nodes (the port defaults
  to 6379; the client learns the rest from ``CLUSTER SLOTS``). Options:
  ``ssl_*`` and ``client_name``. A plain ``redis://`` URL of a node whose
  ``INFO cluster`` says ``cluster_enabled:1`` is taken as that cluster too
  (``silo/redis_util.py``). What lives in which slot: docs/cluster.md.

Two query options apply to every form and are removed before redis-py sees
the URL: ``wait_replicas`` (how many replicas a directory registration or a
state write waits for with ``WAIT``; default 1 for a Sentinel URL, 0
otherwise) and ``wait_timeout_ms`` (the most it waits; default 100).

Credentials: the userinfo ends at the URL's last ``@`` (:func:`split_userinfo`), for the
parsers and for :func:`redact` alike, so a password pasted with a raw ``@`` or ``/`` is
sent whole and never shows in a log, not even its tail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from silo.errors import ConfigError

__all__ = [
    "ClusterTarget", "RedisTarget", "SentinelTarget", "cluster_of", "parse_redis_url", "redact", "split_userinfo",
]  # fmt: skip

SENTINEL_PORT = 26379
REDIS_PORT = 6379
DEFAULT_WAIT_TIMEOUT_MS = 100

_DIRECT_SCHEMES = ("redis", "rediss", "unix")
_SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
_CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True, "redis-cluster": False, "rediss-cluster": True}
_OURS = ("wait_replicas", "wait_timeout_ms")
# Options a Sentinel URL may carry for the connections to the data nodes (and, for TLS, the
# sentinels); anything else is a typo we would rather report than ignore.
_SENTINEL_CONNECTION_OPTIONS = (
    "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname",
    "ssl_ca_path", "client_name",
)  # fmt: skip
_SENTINEL_OWN_OPTIONS = ("sentinel_username", "sentinel_password", "min_other_sentinels")


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """The master of one Sentinel service."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    min_other_sentinels: int = 0
    connection_options: dict[str, str] = field(default_factory=dict)
    """``ssl_*`` and ``client_name`` options for every connection (data nodes and, with TLS, sentinels)."""


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    """A Redis Cluster, reached through any of its startup nodes."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    connection_options: dict[str, str] = field(default_factory=dict)
    """``ssl_*`` and ``client_name`` options for every node connection."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where redgrain's state lives, and how long a write waits for replicas."""

    url: str
    """The URL as given (for messages use :func:`redact`)."""
    direct_url: str | None
    """A single-server URL for redis-py's ``from_url``, without our own options; None for Sentinel."""
    sentinel: SentinelTarget | None
    wait_replicas: int
    """Replicas a registration or state write waits for (``WAIT``); 0: none."""
    wait_timeout_ms: int
    """The longest such a wait takes; a write is not failed when it runs out (see redis_util.replicate)."""
    cluster: ClusterTarget | None = None
    """Set for a Redis Cluster URL (``direct_url`` and ``sentinel`` are None then)."""


def split_userinfo(url: str) -> tuple[str, str | None, str]:
    """``url`` as (scheme, userinfo, the rest): the one rule by which redgrain finds credentials.

    The userinfo runs from ``://`` to the *last* ``@`` of the URL, so a password
    holding an unescaped ``@``, ``/``, ``?`` or ``#`` stays whole (RFC 3986 wants
    them percent-encoded; people paste them raw). An ``@`` in a query value or a
    socket path must then be written ``%40``. A URL whose part after ``://``
    starts with ``/`` (``unix:///path``) has no userinfo. :func:`redact` and every
    parser below split by this rule alone, so what a log hides is what the
    client sends as the password. ``userinfo`` is None when there is none (or no ``://``).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, None, ""
    userinfo, at, after = rest.rpartition("@")
    if not at or rest.startswith("/"):
        return scheme, None, rest
    return scheme, userinfo, after


# Query options that carry a secret (redis-py takes ``password`` in the query of a unix:// URL).
_SECRET_OPTIONS = re.compile(r"(?<=[?&])(password|sentinel_password)=[^&#]*", re.IGNORECASE)


def redact(url: str) -> str:
    """The URL with its password (and any ``password``/``sentinel_password`` option) as ``***``.

    For logs and error messages; credentials are found by :func:`split_userinfo`, as the parsers find them.
    """
    scheme, userinfo, after = split_userinfo(url)
    if not after and userinfo is None:
        return url
    after = _SECRET_OPTIONS.sub(lambda m: f"{m.group(1)}=***", after)
    if userinfo is None:
        return f"{scheme}://{after}"
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{after}"


def parse_redis_url(url: str) -> RedisTarget:
    """Parse any Redis URL redgrain accepts; a malformed or unsupported one raises ConfigError."""
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ConfigError(f"not a Redis URL (no scheme): {redact(url)!r}")
    if scheme in _CLUSTER_SCHEMES:
        return _parse_cluster(url, tls=_CLUSTER_SCHEMES[scheme])
    if scheme in _SENTINEL_SCHEMES:
        return _parse_sentinel(url, tls=_SENTINEL_SCHEMES[scheme])
    if scheme not in _DIRECT_SCHEMES:
        raise ConfigError(
            f"unknown Redis URL scheme {scheme!r} in {redact(url)!r}: expected redis://, rediss://, unix://, "
            "redis+sentinel://, rediss+sentinel://, redis+cluster:// or rediss+cluster://"
        )
    parts = urlsplit(_quoted_userinfo(url))
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _OURS}
    rest = [(k, v) for k, v in query if k not in _OURS]
    direct = urlunsplit(parts._replace(query=urlencode(rest)))
    return RedisTarget(
        url=url,
        direct_url=direct,
        sentinel=None,
        wait_replicas=_int(ours, "wait_replicas", 0, url),
        wait_timeout_ms=_int(ours, "wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS, url),
    )


def _parse_sentinel(url: str, *, tls: bool) -> RedisTarget:
    _, userinfo, rest = split_userinfo(url)
    netloc, slash, tail = rest.partition("/")
    path, _, query_text = tail.partition("?")
    if not slash or not path.strip("/"):
        raise ConfigError(
            f"a Sentinel URL names its service: redis+sentinel://host:port[,host:port...]/service[/db] "
            f"(got {redact(url)!r})"
        )
    username, password = _credentials(userinfo)
    sentinels = tuple(_host_port(h, url) for h in netloc.split(",") if h.strip())
    if not sentinels:
        raise ConfigError(f"a Sentinel URL lists at least one sentinel host:port (got {redact(url)!r})")
    segments = [unquote(s) for s in path.strip("/").split("/")]
    if len(segments) > 2:
        raise ConfigError(f"a Sentinel URL's path is /service[/db] (got {redact(url)!r})")
    service = segments[0]
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise ConfigError(f"the database in {redact(url)!r} is not a number: {segments[1]!r}")
        db = int(segments[1])
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    if "db" in query:  # redis-py's own spelling, accepted too
        db = _int(query, "db", db, url)
        del query["db"]
    unknown = sorted(set(query) - set(_OURS) - set(_SENTINEL_CONNECTION_OPTIONS) - set(_SENTINEL_OWN_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} in Sentinel URL {redact(url)!r}; known: "
            f"{', '.join((*_OURS, *_SENTINEL_OWN_OPTIONS, *_SENTINEL_CONNECTION_OPTIONS))}"
        )
    target = SentinelTarget(
        sentinels=sentinels,
        service=service,
        db=db,
        tls=tls,
        username=username,
        password=password,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=query.get("sentinel_password") or None,
        min_other_sentinels=_int(query, "min_other_sentinels", 0, url),
        connection_options={k: v for k, v in query.items() if k in _SENTINEL_CONNECTION_OPTIONS},
    )
    return RedisTarget(
        url=url,
        direct_url=None,
        sentinel=target,
        wait_replicas=_int(query, "wait_replicas", 1, url),
        wait_timeout_ms=_int(query, "wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS, url),
    )


def _parse_cluster(url: str, *, tls: bool) -> RedisTarget:
    _, userinfo, rest = split_userinfo(url)
    rest, _, query_text = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ConfigError(f"a Redis Cluster has only database 0: drop the path of {redact(url)!r}")
    username, password = _credentials(userinfo)
    nodes = tuple(_host_port(h, url, REDIS_PORT) for h in netloc.split(",") if h.strip())
    if not nodes:
        raise ConfigError(f"a Redis Cluster URL lists at least one node host:port (got {redact(url)!r})")
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    unknown = sorted(set(query) - set(_OURS) - set(_SENTINEL_CONNECTION_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} in Redis Cluster URL {redact(url)!r}; known: "
            f"{', '.join((*_OURS, *_SENTINEL_CONNECTION_OPTIONS))}"
        )
    return RedisTarget(
        url=url,
        direct_url=None,
        sentinel=None,
        wait_replicas=_int(query, "wait_replicas", 0, url),
        wait_timeout_ms=_int(query, "wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS, url),
        cluster=ClusterTarget(
            nodes=nodes,
            tls=tls,
            username=username,
            password=password,
            connection_options={k: v for k, v in query.items() if k in _SENTINEL_CONNECTION_OPTIONS},
        ),
    )


def cluster_of(target: RedisTarget) -> RedisTarget:
    """A single-server target whose node turned out to be a Redis Cluster node, as a cluster target."""
    if target.direct_url is None or target.cluster is not None:
        return target
    parts = urlsplit(target.direct_url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ConfigError(f"{redact(target.url)} is a Redis Cluster node: reach it over TCP (host:port)")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    return RedisTarget(
        url=target.url,
        direct_url=None,
        sentinel=None,
        wait_replicas=target.wait_replicas,
        wait_timeout_ms=target.wait_timeout_ms,
        cluster=ClusterTarget(
            nodes=((parts.hostname, parts.port or REDIS_PORT),),
            tls=parts.scheme == "rediss",
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
            connection_options={k: v for k, v in query.items() if k in _SENTINEL_CONNECTION_OPTIONS},
        ),
    )


def _credentials(userinfo: str | None) -> tuple[str | None, str | None]:
    """``user:password`` (from :func:`split_userinfo`) as (username, password), each unquoted."""
    if userinfo is None:
        return None, None
    user, colon, pw = userinfo.partition(":")
    return unquote(user) or None, unquote(pw) if colon else None


def _quoted_userinfo(url: str) -> str:
    """``url`` with its userinfo percent-encoded, so urlsplit and redis-py's ``from_url`` (which
    split at the first ``/``) find the credentials :func:`split_userinfo` finds."""
    scheme, userinfo, after = split_userinfo(url)
    if userinfo is None:
        return url
    user, colon, pw = userinfo.partition(":")
    cred = quote(unquote(user), safe="") + (":" + quote(unquote(pw), safe="") if colon else "")
    return f"{scheme}://{cred}@{after}"


def _host_port(text: str, url: str, default_port: int = SENTINEL_PORT) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [::1]:26379
        host, _, after = text[1:].partition("]")
        port_text = after[1:] if after.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ConfigError(f"empty host in {redact(url)!r}")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"bad port {port_text!r} in {redact(url)!r}")
    return host, int(port_text)


def _int(query: dict[str, str], name: str, default: int, url: str) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit():
        raise ConfigError(f"{name} in {redact(url)!r} must be a whole number ≥ 0, got {raw!r}")
    return int(raw)
