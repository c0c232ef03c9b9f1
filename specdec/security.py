"""TLS for the public API, mTLS between orchestrator and workers, bearer-token auth (public API)."""
from __future__ import annotations

import hmac
import logging
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


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS; with client_ca, clients must present a certificate signed by it (mTLS)."""
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=_read(client_ca),
                                       require_client_auth=client_ca is not None)


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
