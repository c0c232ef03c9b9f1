"""Building and running the orchestrator server (shared by the CLI, the demo and the tests)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
import tomllib
from dataclasses import dataclass
from typing import Any

from orchestrator import servicer as orch_servicer
from orchestrator.admission import Admission
from orchestrator.clients import EmulatedLatency, GrpcDraftBackend, GrpcTargetBackend, open_channel
from orchestrator.config import SpeculationConfig, SpeculationConfigError
from orchestrator.api import EngineLimits
from orchestrator.engine import GenerationEngine
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.routing import ReplicaPool, RoutedDraft, RoutedTarget, parse_targets
from orchestrator.traces import TraceWriter
from specdec import grpc_util, security
from specdec.errors import DeadlineExceeded, SpecdecError, WorkerUnavailable
from specdec.metrics import serve_metrics
from specdec.tokenizers import load_tokenizer

log = logging.getLogger(__name__)

# grpc.health.v1 service name reporting the draft worker as seen by this orchestrator.
DRAFT_HEALTH_NAME = "specdec.v1.Orchestrator/draft"


@dataclass(frozen=True)
class OrchestratorConfig:
    draft_address: str
    target_address: str
    tokenizer: str
    speculation: SpeculationConfig = SpeculationConfig()
    limits: EngineLimits = EngineLimits()
    max_concurrent: int = 8
    max_queue: int = 32
    rate_per_s: float = 0.0
    host: str = "127.0.0.1"
    port: int = 0
    connect_timeout_s: float = 120.0
    trace_file: str | None = None
    # Security: TLS on the public API, bearer tokens, mTLS to the workers.
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_tokens: tuple[str, ...] = ()
    worker_ca: str | None = None
    worker_client_cert: str | None = None
    worker_client_key: str | None = None
    worker_server_name: str | None = None
    metrics_port: int | None = None
    health_port: int | None = None  # plaintext health-only port (grpc_util.start_server)
    discovery_refresh_s: float = 5.0
    emulated_one_way_ms: float = 0.0  # benchmarks: network latency emulated on loopback


async def wait_for_worker(backend: Any, timeout_s: float, role: str = "worker", total_s: float | None = None):
    """Workers may still be loading their model: retry GetInfo until timeout, then exit naming the
    worker (a clear last log line for the pod, not a traceback). total_s: the --connect-timeout-s
    that timeout_s is what is left of."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await backend.describe(timeout_s=5.0)
        except (WorkerUnavailable, DeadlineExceeded) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise SystemExit(f"the {role} worker did not answer GetInfo within --connect-timeout-s "
                                 f"({timeout_s if total_s is None else total_s:.0f} s): {exc}") from exc
            await asyncio.sleep(0.5)


async def wait_for_workers(target: Any, draft: Any, timeout_s: float) -> tuple[Any, Any]:
    """Both workers' descriptions, within one timeout for the two (the k8s startup probe is sized
    on it: each with its own, the orchestrator could wait twice as long and be killed first)."""
    started = asyncio.get_running_loop().time()
    target_info = await wait_for_worker(target, timeout_s, "target")
    return target_info, await wait_for_worker(draft, timeout_s - (asyncio.get_running_loop().time() - started),
                                              "draft", total_s=timeout_s)


SETTLE_S = 5.0  # at shutdown, the most to wait for sessions being ended on the workers
RTT_PINGS = 3  # GetInfo calls per worker at startup; the fastest one is the round trip


async def measure_rtt_ms(backend: Any, role: str, pings: int = RTT_PINGS) -> float | None:
    """The shortest wall time of a few GetInfo calls to a worker that is up: the network and serving
    overhead every call to it pays on top of its compute. It seeds the policies' RTTs, so that a far
    worker is priced from the first round of a fresh deployment. None if no ping answered."""
    best: float | None = None
    for _ in range(pings):
        start = time.perf_counter()
        try:
            await backend.describe(timeout_s=5.0)
        except SpecdecError as err:
            log.warning("RTT ping to the %s failed (%s); the policies start from a guess", role, err)
            return best
        ms = (time.perf_counter() - start) * 1000.0
        best = ms if best is None else min(best, ms)
    return best


async def build_engine(cfg: OrchestratorConfig, metrics: OrchestratorMetrics | None = None
                       ) -> tuple[GenerationEngine, RoutedDraft, RoutedTarget]:
    creds = (security.channel_credentials(cfg.worker_ca, cfg.worker_client_cert, cfg.worker_client_key)
             if cfg.worker_ca else None)

    interceptors = [EmulatedLatency(cfg.emulated_one_way_ms)] if cfg.emulated_one_way_ms > 0 else []

    def channel(address: str) -> Any:
        return open_channel(address, creds, cfg.worker_server_name, interceptors)

    draft_pool = ReplicaPool("draft", cfg.draft_address, lambda a: GrpcDraftBackend(a, channel(a)),
                             cfg.discovery_refresh_s)
    target_pool = ReplicaPool("target", cfg.target_address, lambda a: GrpcTargetBackend(a, channel(a)),
                              cfg.discovery_refresh_s)
    await draft_pool.start()
    await target_pool.start()
    draft, target = RoutedDraft(draft_pool), RoutedTarget(target_pool)
    target_info, draft_info = await wait_for_workers(target, draft, cfg.connect_timeout_s)
    if draft_info.tokenizer_fingerprint != target_info.tokenizer_fingerprint:
        raise SystemExit(f"draft ({draft_info.model_ref}) and target ({target_info.model_ref}) use different "
                         "tokenizers; speculative decoding needs a shared vocabulary")
    if draft_info.vocab_size != target_info.vocab_size:
        log.warning("draft vocab %d != target vocab %d (padding rows); the draft drafts only ids the tokenizer "
                    "knows", draft_info.vocab_size, target_info.vocab_size)
    if draft_info.max_context < target_info.max_context:
        log.warning("draft context (%d) is shorter than the target's (%d): rounds past it run target-only",
                    draft_info.max_context, target_info.max_context)
    draft_rtt_ms, target_rtt_ms = await measure_rtt_ms(draft, "draft"), await measure_rtt_ms(target, "target")
    log.info("round trip at startup (GetInfo): draft %s ms, target %s ms", _ms(draft_rtt_ms), _ms(target_rtt_ms))
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.tokenizer)
    observers: list[Any] = [metrics] if metrics is not None else []
    if cfg.trace_file:
        observers.append(TraceWriter(cfg.trace_file))
    engine = GenerationEngine(draft, target, tokenizer, target_info, cfg.speculation, cfg.limits, observers,
                              draft_info=draft_info, draft_rtt_ms=draft_rtt_ms, target_rtt_ms=target_rtt_ms)
    log.info("draft %s at %s, target %s at %s", draft_info.model_ref, cfg.draft_address,
             target_info.model_ref, cfg.target_address)
    return engine, draft, target


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


async def start_orchestrator(cfg: OrchestratorConfig):
    metrics = OrchestratorMetrics() if cfg.metrics_port is not None else None
    engine, draft, target = await build_engine(cfg, metrics)
    servicer = orch_servicer.OrchestratorServicer(engine, Admission(cfg.max_concurrent, cfg.max_queue, cfg.rate_per_s),
                                                  metrics)
    credentials = security.server_credentials(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
    interceptors = [security.BearerTokenInterceptor(list(cfg.auth_tokens))] if cfg.auth_tokens else []
    handle = await grpc_util.start_server(lambda s: orch_servicer.register(servicer, s),
                                          [orch_servicer.SERVICE_NAME], host=cfg.host, port=cfg.port,
                                          credentials=credentials, interceptors=interceptors,
                                          health_port=cfg.health_port)
    if metrics is not None:
        handle.metrics_port = serve_metrics(cfg.metrics_port, metrics.registry, cfg.host)

    # Health entry for the draft dependency: NOT_SERVING while generation falls back to target-only.
    async def report_draft(degraded: bool) -> None:
        await handle.set_status(DRAFT_HEALTH_NAME, not degraded)
    engine.draft_health.on_change = report_draft
    await report_draft(False)
    return handle, servicer, (draft, target)


def add_args(parser: argparse.ArgumentParser) -> None:
    from specdec.embedded import DEFAULT_TARGET
    parser.add_argument("--draft", required=True,
                        help="draft replicas: host:port[,host:port...] or dns:///headless-service:port")
    parser.add_argument("--target", required=True,
                        help="target replicas: host:port[,host:port...] or dns:///headless-service:port")
    parser.add_argument("--discovery-refresh-s", type=float, default=5.0, help="DNS re-resolution period")
    parser.add_argument("--connect-timeout-s", type=float, default=120.0,
                        help="at startup, wait this long for both workers to answer (they may still be loading "
                             "and calibrating their models) before exiting; the public port opens after")
    parser.add_argument("--target-timeout-s", type=float, default=600.0,
                        help="longest a Verify call may take (a prompt's prefill included) before UNAVAILABLE")
    parser.add_argument("--tls-cert", help="PEM certificate for the public API (TLS)")
    parser.add_argument("--tls-key", help="PEM private key for the public API")
    parser.add_argument("--auth-token-file", help="bearer tokens, one per line; callers without one get UNAUTHENTICATED")
    parser.add_argument("--worker-ca", help="CA that signed the workers' certificates (enables TLS to workers)")
    parser.add_argument("--worker-client-cert", help="client certificate presented to workers (mTLS)")
    parser.add_argument("--worker-client-key", help="key of the client certificate")
    parser.add_argument("--worker-server-name", help="name expected in worker certificates (default: the host)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: any)")
    parser.add_argument("--health-port", type=int,
                        help="also serve grpc.health.v1 alone, in plaintext, on this port: for kubelet's grpc "
                             "probes when the API port uses TLS")
    parser.add_argument("--tokenizer", default=DEFAULT_TARGET, help="tokenizer ref (the target's model ref)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file")
    parser.add_argument("--config", help="TOML file with a [speculation] table (policy, min_k, max_k, ...)")
    parser.add_argument("--policy", help="default k policy: fixed, heuristic, cost, bandit")
    parser.add_argument("--min-k", type=int)
    parser.add_argument("--max-k", type=int)
    parser.add_argument("--fixed-k", type=int)
    parser.add_argument("--min-draft-prob", type=float)
    parser.add_argument("--max-new-tokens-limit", type=int, default=4096)
    parser.add_argument("--max-concurrent", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=32)
    parser.add_argument("--rate-per-s", type=float, default=0.0, help="admission rate limit (0: off)")
    parser.add_argument("--max-sessions", type=int, default=10_000)
    parser.add_argument("--max-session-tokens", type=int, default=16_000_000,
                        help="tokens of history held over all sessions (about 50 bytes each); least "
                             "recently used sessions are evicted beyond it")
    parser.add_argument("--session-ttl-s", type=float, default=600.0)
    parser.add_argument("--grace-s", type=float, default=10.0, help="drain time for in-flight requests on SIGTERM")
    parser.add_argument("--drain-delay-s", type=float, default=0.0,
                        help="on SIGTERM, report NOT_SERVING this long before refusing new requests")
    parser.add_argument("--trace-file", help="append one JSON line per round here (for `specdec tune`)")
    parser.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                        help="pipelined rounds (default: the config's, off)")
    parser.add_argument("--emulate-one-way-latency-ms", type=float, default=0.0,
                        help="benchmarks only: delay each direction of every worker call by this much")
    parser.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> OrchestratorConfig:
    """The configuration from the flags, checked before anything waits for the workers."""
    try:
        Admission.check_limits(args.max_concurrent, args.max_queue, args.rate_per_s)
    except ValueError as exc:
        raise SystemExit(f"--max-concurrent, --max-queue, --rate-per-s: {exc}") from None
    for flag in ("max_sessions", "max_session_tokens"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    for flag in ("connect_timeout_s", "discovery_refresh_s", "target_timeout_s", "session_ttl_s"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):  # 0 made the DNS refresh a busy loop; every session expire
            raise SystemExit(f"--{flag.replace('_', '-')} must be a number of seconds > 0, got {value}")
    for flag in ("grace_s", "drain_delay_s"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value >= 0):
            raise SystemExit(f"--{flag.replace('_', '-')} must be a number of seconds >= 0, got {value}")
    if args.max_new_tokens_limit < 1:  # 0 refused every request
        raise SystemExit(f"--max-new-tokens-limit must be at least 1, got {args.max_new_tokens_limit}")
    security.check_tls_flags(args, {"--tls-cert": ("--tls-key",), "--tls-key": ("--tls-cert",),
                                    "--worker-client-cert": ("--worker-client-key", "--worker-ca"),
                                    "--worker-client-key": ("--worker-client-cert", "--worker-ca"),
                                    "--worker-server-name": ("--worker-ca",)})
    for flag in ("draft", "target"):
        try:
            parse_targets(getattr(args, flag))
        except ValueError as exc:
            raise SystemExit(f"--{flag}: {exc}") from None
    security.check_tls_files((args.tls_cert, args.tls_key, None),
                             (args.worker_ca, args.worker_client_cert, args.worker_client_key))
    try:
        auth_tokens = tuple(security.load_tokens(args.auth_token_file)) if args.auth_token_file else ()
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--auth-token-file: {exc}") from None
    if args.auth_token_file and not args.tls_cert:  # allowed: TLS may end at a mesh sidecar in front
        log.warning("--auth-token-file without --tls-cert/--tls-key: bearer tokens arrive in plaintext "
                    "unless a proxy in front of this port terminates TLS")
    flags = {"policy": args.policy, "min_k": args.min_k, "max_k": args.max_k, "fixed_k": args.fixed_k,
             "min_draft_prob": args.min_draft_prob, "pipeline": args.pipeline}
    try:  # a clear exit, not a traceback, for a bad or missing file or flag value
        spec = SpeculationConfig.from_toml(args.config) if args.config else SpeculationConfig()
        spec = spec.with_values({k: v for k, v in flags.items() if v is not None},  # flags beat the file
                                f"flags over {args.config}" if args.config else "flags")
    except (SpeculationConfigError, OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"speculation config: {exc}") from None
    limits = EngineLimits(max_new_tokens=args.max_new_tokens_limit, max_sessions=args.max_sessions,
                          max_session_tokens=args.max_session_tokens,
                          session_ttl_s=args.session_ttl_s, target_timeout_s=args.target_timeout_s)
    return OrchestratorConfig(args.draft, args.target, args.tokenizer, spec, limits, args.max_concurrent,
                              args.max_queue, args.rate_per_s, args.host, args.port, trace_file=args.trace_file,
                              tls_cert=args.tls_cert, tls_key=args.tls_key,
                              auth_tokens=auth_tokens,
                              worker_ca=args.worker_ca, worker_client_cert=args.worker_client_cert,
                              worker_client_key=args.worker_client_key, worker_server_name=args.worker_server_name,
                              metrics_port=args.metrics_port, discovery_refresh_s=args.discovery_refresh_s,
                              emulated_one_way_ms=args.emulate_one_way_latency_ms,
                              connect_timeout_s=args.connect_timeout_s, health_port=args.health_port)


async def serve(args: argparse.Namespace) -> None:
    handle, servicer, backends = await start_orchestrator(config_from_args(args))
    try:
        await grpc_util.run_until_signalled(handle, args.grace_s, args.port_file, drain_delay_s=args.drain_delay_s)
        await servicer.engine.settle(SETTLE_S)  # else their caches stay on the workers until the TTL
    finally:
        for backend in backends:
            await backend.close()
