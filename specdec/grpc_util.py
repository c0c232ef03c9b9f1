"""gRPC glue shared by all three services: status mapping, server bootstrap, health, shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.errors import SpecdecError

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
UNWIND_S = 0.1  # at shutdown, after the grace: for the cancelled handlers to finish
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect to a restarted worker within seconds, not gRPC's default of up to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 3000),
]
KEEPALIVE_MS = dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"]


def server_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """The channel's sizes and keepalive, and the clients' keepalive pings accepted, idle connections
    included: by gRPC's default a server wants 5 minutes between pings without data, and after two
    early ones sent GOAWAY "too_many_pings" (idle worker channels dropped every minute or two). A
    shorter minimum interval alone did not stop it while the server pings too: no strikes at all."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", dict(CHANNEL_OPTIONS)["grpc.keepalive_timeout_ms"]),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_ms // 2),
            ("grpc.http2.max_ping_strikes", 0)]


def status_code(error: SpecdecError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.code_name, grpc.StatusCode.INTERNAL)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the status that fits the error; INTERNAL only for bugs."""
    if isinstance(exc, SpecdecError):
        retry_after_ms = getattr(exc, "retry_after_ms", None)
        if retry_after_ms is not None:  # RESOURCE_EXHAUSTED from a full queue: when to come back
            context.set_trailing_metadata((("retry-after-ms", str(int(retry_after_ms))),))
        await context.abort(status_code(exc), str(exc))
    # The caller gets the bug's kind and an id to find it in this server's log, not its text (which
    # can carry paths, tensors or other sessions' data).
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s", error_id, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); logged as {error_id}")


class MalformedRequest:
    """What the deserializer returns for bytes that are not a valid message (e.g. invalid UTF-8 in a
    string field). The handler answers INVALID_ARGUMENT instead of gRPC's default INTERNAL."""

    def __init__(self, type_name: str) -> None:
        self.message = (f"request is not a valid {type_name} (malformed bytes or invalid UTF-8 in a "
                        "string field)")


def _safe_deserializer(cls: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except pb_message.DecodeError:
            return MalformedRequest(cls.DESCRIPTOR.full_name)
    return deserialize


def add_service(server: grpc.aio.Server, service: ServiceDescriptor, servicer: Any) -> None:
    """Register a servicer for a service descriptor (unary and server-streaming methods).

    The one place where errors become statuses: malformed request bytes get INVALID_ARGUMENT, a
    SpecdecError its own code, anything else INTERNAL (logged: it is a bug). Servicers just raise.
    """
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name)
        kwargs = dict(request_deserializer=_safe_deserializer(request_cls),
                      response_serializer=response_cls.SerializeToString)
        if method.server_streaming:
            async def stream(request: Any, context: grpc.aio.ServicerContext, impl: Any = impl) -> Any:
                if isinstance(request, MalformedRequest):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                try:
                    # aclosing: a stream gRPC drops (cancelled while a write blocked) closes the
                    # servicer's generator now, not at some later garbage collection.
                    async with contextlib.aclosing(impl(request, context)) as items:
                        async for item in items:
                            yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status code
                    await abort_with(context, exc)
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(stream, **kwargs)
        else:
            async def unary(request: Any, context: grpc.aio.ServicerContext, impl: Any = impl) -> Any:
                if isinstance(request, MalformedRequest):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                try:
                    return await impl(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status code
                    await abort_with(context, exc)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class ServerHandle:
    """A running aio server with health; `stop()` flips health to NOT_SERVING and drains."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer,
                 services: list[str]) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.services = services
        self.metrics_port: int | None = None
        self.health_server: grpc.aio.Server | None = None  # the plaintext health-only port, if any
        self.health_port: int | None = None

    async def set_serving(self, serving: bool) -> None:
        for name in ["", *self.services]:
            await self.set_status(name, serving)

    async def set_status(self, name: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0, drain_delay_s: float = 0.0) -> None:
        """NOT_SERVING first (load balancers and readiness probes move traffic away during
        drain_delay_s), then stop accepting RPCs and let in-flight ones finish within grace_s."""
        await self.set_serving(False)
        # Every entry, those set since start too (the orchestrator's .../draft), and none set back.
        await self.health.enter_graceful_shutdown()
        if drain_delay_s > 0:
            await asyncio.sleep(drain_delay_s)
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)


def delayed_call(call: Callable[[Any, Any], Awaitable[Any]], ms: float) -> Callable[[Any, Any], Awaitable[Any]]:
    """A servicer method that waits `ms` before it serves: a worker on a far node, emulated on
    loopback by benchmarks and tests (set on the servicer before it is registered)."""
    async def wait_then_call(request: Any, context: Any) -> Any:
        await asyncio.sleep(ms / 1000.0)
        return await call(request, context)
    return wait_then_call


def bare_host(host: str) -> str:
    """--host as given, brackets taken off an IPv6 literal ("[::1]" -> "::1"): what socket APIs want."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """"host:port" for gRPC, an IPv6 literal in brackets ("[::]:50051"; ":::50051" binds nothing)."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_server(register: Callable[[grpc.aio.Server], None], service_names: list[str],
                       host: str = "127.0.0.1", port: int = 0,
                       credentials: grpc.ServerCredentials | None = None,
                       interceptors: list[Any] | None = None,
                       keepalive_ms: int = KEEPALIVE_MS, health_port: int | None = None) -> ServerHandle:
    """health_port: also serve grpc.health.v1 alone, in plaintext, on this port (0: any), with the
    same statuses: kubelet's grpc probes speak plaintext, so with TLS on the API port they need it."""
    server = grpc.aio.server(options=server_options(keepalive_ms), interceptors=interceptors or [])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = host_port(host, port)
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    handle = ServerHandle(server, bound, health_servicer, service_names)
    if health_port is not None:
        handle.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, handle.health_server)
        handle.health_port = handle.health_server.add_insecure_port(host_port(host, health_port))
        if handle.health_port == 0:
            await server.stop(0)
            raise RuntimeError(f"could not bind the health port {host_port(host, health_port)}")
        await handle.health_server.start()
    await handle.set_serving(True)
    return handle


async def run_until_signalled(handle: ServerHandle, grace_s: float, port_file: str | None = None,
                              on_stop: Callable[[], Awaitable[None]] | None = None,
                              drain_delay_s: float = 0.0) -> None:
    """Serve until SIGTERM/SIGINT; then NOT_SERVING, drain in-flight calls for grace_s, exit."""
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(str(handle.port))
        tmp.rename(port_file)  # atomic: readers never see a partial number
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving on port %d", handle.port)
    await stop.wait()
    log.info("shutting down: NOT_SERVING, draining in-flight calls for up to %.1fs", grace_s)
    if on_stop:
        await on_stop()
    await handle.stop(grace_s, drain_delay_s)
    # gRPC cancelled the calls still running at the end of the grace: let their handlers unwind
    # before the caller closes what they use (else each logged an ERROR with a traceback at exit).
    await asyncio.sleep(UNWIND_S)
    log.info("stopped")
