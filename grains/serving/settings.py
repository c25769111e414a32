"""The fronts' settings: what each wire lets one client cost, and TLS (docs/security.md, "The inference fronts").

``FrontSettings`` is read once by ``redgrain serve`` (environment variables
``REDGRAIN_FRONT__GRPC__PINGS_PER_S=...``; the ``--tls-*`` flags fill in
:class:`TlsSettings`); each front receives only its own section. The
defaults are meant for a front reachable by clients one does not trust: a
well-behaved client (tritonclient, grpc's own, h2load) never comes near
them, an abusive connection is closed within a second.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GrpcLimits(_Section):
    """What one gRPC (HTTP/2) connection may cost the front; past a per-second bound: GOAWAY ENHANCE_YOUR_CALM."""

    max_connections: int = Field(1024, ge=1, description="Open connections at once; more are closed at once.")
    handshake_timeout_s: float = Field(10.0, gt=0, description="Time a new connection has to send the HTTP/2 preface.")
    idle_timeout_s: float = Field(
        300.0, gt=0, description="A connection with no call open and nothing received for this long is closed (GOAWAY)."
    )
    max_message_bytes: int = Field(
        32 << 20, ge=1 << 10,
        description="Largest request or answer message (grpc's default is 4 MiB); a bigger one is refused, "
        "RESOURCE_EXHAUSTED. One connection may buffer a whole one: it bounds what one client makes the front hold.",
    )  # fmt: skip
    max_buffered_bytes: int = Field(
        (32 + 8) << 20, ge=1 << 20,
        description="Request bytes one connection may have buffered before handlers take them; the connection's "
        "receive window is given back only below it. Unset: the largest message plus 8 MiB; never less than a "
        "message plus 5 bytes.",
    )  # fmt: skip
    resets_per_s: int = Field(
        1000, ge=1, description="RST_STREAMs a client may send a second (rapid reset, CVE-2023-44487)."
    )
    pings_per_s: int = Field(100, ge=1, description="PINGs a client may send a second.")
    settings_per_s: int = Field(100, ge=1, description="SETTINGS frames a client may send a second.")
    max_settings_entries: int = Field(
        64, ge=8, description="Entries in one SETTINGS frame (a client sends a handful; nghttp2 allows 32)."
    )

    @model_validator(mode="before")
    @classmethod
    def _buffer_follows_message(cls, data: Any) -> Any:
        # Raising only max_message_bytes must not leave a buffer that cannot hold one message.
        if isinstance(data, dict) and "max_message_bytes" in data and "max_buffered_bytes" not in data:
            data = {**data, "max_buffered_bytes": int(data["max_message_bytes"]) + (8 << 20)}
        return data

    @model_validator(mode="after")
    def _room_for_a_message(self) -> Self:
        if self.max_buffered_bytes < self.max_message_bytes + 5:
            raise ValueError(
                f"max_buffered_bytes {self.max_buffered_bytes} cannot hold one message of max_message_bytes "
                f"{self.max_message_bytes} (a message plus its 5-byte prefix)"
            )
        return self
    empty_frames_per_s: int = Field(
        100, ge=1, description="DATA and CONTINUATION frames without payload or end flag a client may send a second."
    )
    header_cache_bytes: int = Field(
        64 << 10, ge=0, description="Decoded header blocks kept per connection for reuse (bytes of blocks and headers)."
    )


class HttpLimits(_Section):
    """What one HTTP/1.1 connection may cost the front (slowloris and idle connections)."""

    max_connections: int = Field(1024, ge=1, description="Open connections at once; more are closed at once.")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time to receive a request's whole head, from its first byte (or the connection's start)."
    )
    body_timeout_s: float = Field(60.0, gt=0, description="Time to receive a request's whole body, after its head.")
    max_header_bytes: int = Field(
        64 << 10, ge=4096, description="Bytes of a request's head (request line and headers); more: 431 and closed."
    )
    keep_alive_s: float = Field(5.0, gt=0, description="An idle keep-alive connection is closed after this long.")


class TlsSettings(_Section):
    """TLS on both fronts: a certificate and key, and a CA whose client certificates are then required."""

    cert_file: Path = Field(description="The server's certificate chain (PEM).")
    key_file: Path = Field(description="Its private key (PEM).")
    ca_file: Path | None = Field(None, description="When set, clients must present a certificate this CA signed.")

    @model_validator(mode="after")
    def _files_exist(self) -> Self:
        for path in (self.cert_file, self.key_file, self.ca_file):
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        return self

    def context(self, *, alpn: list[str] | None = None) -> ssl.SSLContext:
        """A server context (TLS 1.2 at least), offering ``alpn`` when given."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.ca_file is not None:
            ctx.load_verify_locations(self.ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx


class FrontSettings(BaseSettings):
    """Everything ``redgrain serve``'s fronts read at start."""

    model_config = SettingsConfigDict(env_prefix="REDGRAIN_FRONT__", env_nested_delimiter="__", frozen=True,
                                      extra="ignore")  # fmt: skip

    grpc: GrpcLimits = GrpcLimits()
    http: HttpLimits = HttpLimits()
    tls: TlsSettings | None = None
