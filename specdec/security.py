"""TLS for the public API, mTLS between orchestrator and workers, bearer-token auth (public API)."""
from __future__ import annotations

import hmac
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

# Probes and tooling must work without a token (kubelet gRPC probes cannot send one).
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def check_tls_flags(args: Any, needs: dict[str, tuple[str, ...]]) -> None:
    """Refuse (SystemExit) TLS flags given without their partners: `needs` maps a flag to the flags it
    needs, read from the parsed `args`. A half-given pair ran plaintext, the bearer tokens in clear."""
    def given(flag: str) -> bool:
        return bool(getattr(args, flag.removeprefix("--").replace("-", "_")))
    for flag, partners in needs.items():
        missing = [p for p in partners if given(flag) and not given(p)]
        if missing:
            raise SystemExit(f"{flag} needs {' and '.join(missing)} (without them the service would run "
                             "without TLS)")


class TlsFilesError(ValueError):
    """A certificate, key or CA file that is missing, unreadable, not PEM, or a key not of the certificate."""


def _pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsFilesError(f"{what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TlsFilesError(f"{what} {path}: not a PEM file")
    return data


def check_key_pair(cert: str, key: str, flags: tuple[str, str] = ("--tls-cert", "--tls-key")) -> None:
    """The key is the certificate's (grpc would only find out at the first handshake, and fail it)."""
    import ssl
    try:
        # An empty password: an encrypted key fails here at once (without one, OpenSSL would prompt
        # on the terminal, inside grpc's fetcher). grpc takes no passphrase anyway.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except (ssl.SSLError, OSError) as exc:
        raise TlsFilesError(f"{flags[0]} {cert} / {flags[1]} {key}: {exc}") from None


def check_ca(path: str, flag: str) -> bytes:
    """The CA file's bytes, once they parse as certificates (checked on the bytes returned)."""
    import ssl
    data = _pem(path, flag)
    try:
        # PEM bodies are ASCII; comment lines (curl's cacert.pem labels) may not be, and cadata
        # refuses a str with any non-ASCII character (TypeError).
        ssl.create_default_context(cadata=data.decode("ascii", errors="ignore"))
    except (ssl.SSLError, ValueError, TypeError) as exc:
        raise TlsFilesError(f"{flag} {path}: {exc}") from None
    return data


class ServerCertificateFiles:
    """The server's certificate, key and (mTLS) client CA as files that may be replaced while it runs
    (cert-manager, a Kubernetes secret's atomic symlink swap): grpc asks before every new connection's
    handshake, and gets a new configuration once the files' stat signature has changed and the new
    set loads and matches; a half-written or mismatched set is logged and the current one kept.
    Connections already open keep the certificate they began with."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None, check_interval_s: float = 1.0) -> None:
        self.paths = tuple(p for p in (cert, key, client_ca) if p)
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._checked_at = -math.inf
        self._signature = self._stat()
        self._refused: tuple | None = None
        self.reloads = 0
        self.initial = self._load()  # raises TlsFilesError: a service must not start on bad files

    def _stat(self) -> tuple:
        out = []
        for path in self.paths:
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        before = [_pem(self.cert, "--tls-cert"), _pem(self.key, "--tls-key")]
        check_key_pair(self.cert, self.key)
        ca = check_ca(self.client_ca, "--tls-client-ca") if self.client_ca else None
        # Read again after the check: the pair handed to grpc is the one checked, not one written in between.
        if [_pem(self.cert, "--tls-cert"), _pem(self.key, "--tls-key")] != before:
            raise TlsFilesError("the certificate or key changed while being read")
        return grpc.ssl_server_certificate_configuration([(before[1], before[0])], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's certificate_configuration_fetcher: a new configuration, or None to keep the current."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked_at < self.check_interval_s:
                return None
            self._checked_at = now
            signature = self._stat()
            if signature == self._signature or signature == self._refused:
                return None
            try:
                config = self._load()
            except TlsFilesError as exc:
                self._refused = signature  # logged once per version of the files, retried when they change
                log.warning("TLS files changed but are not usable (%s); keeping the current certificate", exc)
                return None
            self._signature, self._refused = signature, None
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", ", ".join(self.paths))
            return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self.initial, self.fetch,
                                                   require_client_authentication=self.client_ca is not None)


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS; with client_ca, clients must present a certificate signed by it (mTLS). The files are read
    and checked now (TlsFilesError) and re-read when they change (ServerCertificateFiles). One per
    server: grpc hands a dynamic credential's initial certificate to the first server bound with it."""
    return ServerCertificateFiles(cert, key, client_ca).credentials()


def check_tls_files(server: tuple[str | None, str | None, str | None] = (None, None, None),
                    client: tuple[str | None, str | None, str | None] = (None, None, None)) -> None:
    """At startup, before anything slow: SystemExit with the reason if a given TLS file is missing,
    unreadable, not PEM, or a key not of its certificate. server: (cert, key, client CA); client:
    (CA, cert, key) for the orchestrator's channels to the workers."""
    try:
        cert, key, client_ca = server
        if cert and key:
            ServerCertificateFiles(cert, key, client_ca)
        ca, client_cert, client_key = client
        if ca:
            check_ca(ca, "--worker-ca")
        if client_cert and client_key:
            _pem(client_cert, "--worker-client-cert")
            _pem(client_key, "--worker-client-key")
            check_key_pair(client_cert, client_key, ("--worker-client-cert", "--worker-client-key"))
    except TlsFilesError as exc:
        raise SystemExit(f"TLS: {exc}") from None


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every RPC except health and reflection."""

    def __init__(self, tokens: list[str]) -> None:
        if not tokens or any(not t for t in tokens):
            raise ValueError("bearer auth needs at least one non-empty token")
        self._tokens = [t.encode() for t in tokens]

    def _authorized(self, metadata: Any) -> bool:
        """Any authorization value `Bearer <token>` with a known token (the scheme is case-insensitive,
        RFC 7235)."""
        for key, value in metadata or ():
            if key == "authorization":
                value = value.decode() if isinstance(value, bytes) else value
                scheme, _, presented = value.partition(" ")
                if scheme.lower() == "bearer" and any(hmac.compare_digest(presented.strip().encode(), t)
                                                      for t in self._tokens):
                    return True
        return False

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            yield  # pragma: no cover - makes this an async generator

        kwargs = dict(request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
        return grpc.unary_unary_rpc_method_handler(deny_unary, **kwargs)


def load_tokens(path: str) -> list[str]:
    """One token per line (blank lines and # comments ignored): rotate by adding the new one first."""
    tokens = [line.strip() for line in Path(path).read_text().splitlines()
              if line.strip() and not line.strip().startswith("#")]
    if not tokens:
        raise ValueError(f"{path} holds no tokens")
    return tokens
