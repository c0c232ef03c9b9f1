"""One worker server for both roles: servicer base (EndSession, GetInfo, the model thread)
and bootstrap. Role-specific servicers in draft_worker/ and target_worker/ only convert messages.

Over 300 lines: the flags, their checks before the model loads and the startup that wires them
(calibration, decode graph, health, watchdog, metrics) are one path, read top to bottom."""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import grpc

from specdec import grpc_util
from specdec.calibration import GEMM_PATHS, calibrate, retime_decode_steps
from specdec.decode_graph import DECODE_GRAPH_MODES
from specdec.decode_graph import DEFAULT_MAX_LEN as DEFAULT_GRAPH_LEN
from specdec.decode_graph import resolve_mode as resolve_decode_graph
from specdec.errors import DeadlineExceeded
from specdec.v1 import common_pb2
from specdec.contract import MAX_BRANCH_SLOTS, MAX_K, CallStats, CostCurve, validate_session_id
from specdec.scheduler import (BatchLimits, BatchScheduler, itl_factor_valid, itl_limit_ms, prefill_chunk_for,
                               prefill_chunk_within, watch_for_a_hung_forward)
from specdec.worker_core import ForwardStep, StoreLimits, WorkerCore

log = logging.getLogger(__name__)
T = TypeVar("T")
# --prefill-chunk auto where the worker measured no forward of 16 rows or more (calibration skipped).
AUTO_PREFILL_CHUNK_FALLBACK = 64
# Each stream at most this many times as slow as alone while prompts share its forwards (the ITL bound,
# --prefill-itl-factor): p99 inter-token latency under load about twice one stream's, for later first tokens.
DEFAULT_PREFILL_ITL_FACTOR = 2.0


def _without_forwards(fn: Callable[[], T]) -> Generator[ForwardStep, Any, T]:
    """A call with no forward steps (EndSession), still run on the model thread in its turn."""
    return fn()
    yield  # noqa: unreachable - makes this a generator


class WorkerServicerBase:
    """Hands engine calls to the worker's batch scheduler (one model thread, calls of several
    sessions batched per forward) and maps errors."""

    def __init__(self, core: WorkerCore, limits: BatchLimits = BatchLimits()) -> None:
        self.core = core
        self.scheduler = BatchScheduler(core.feed_many, limits, name=f"{core.role}-model")

    async def run_call(self, context: grpc.aio.ServicerContext, session_id: str,
                       make_steps: Callable[[], Generator[ForwardStep, Any, T]], ends_session: bool = False) -> T:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded("deadline expired before the worker started the call")
        future, load = self.scheduler.submit(session_id, make_steps, remaining, ends_session=ends_session)
        result = await asyncio.wrap_future(future)  # cancelling the RPC cancels the queued call
        stats = getattr(result, "stats", None)
        if isinstance(stats, CallStats):
            snapshot = self.scheduler.snapshot()
            stats.queue_ms = load.queue_ms
            stats.batch_sessions = load.mean_batch
            stats.batch_rows = load.mean_rows
            stats.batch_prompt_rows = load.mean_prompt_rows
            stats.worker_utilisation = snapshot.utilisation
            stats.worker_waiting = snapshot.waiting
        return result

    async def EndSession(self, request: common_pb2.EndSessionRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.EndSessionResponse:
        def end() -> bool:
            validate_session_id(request.session_id)
            return self.core.end_session(request.session_id)
        existed = await self.run_call(context, request.session_id, lambda: _without_forwards(end), ends_session=True)
        return common_pb2.EndSessionResponse(existed=existed)

    async def GetInfo(self, request: common_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerInfo:
        loaded = self.core.loaded
        snapshot = self.scheduler.snapshot()
        return common_pb2.WorkerInfo(
            role=self.core.role, model_ref=loaded.ref, vocab_size=loaded.vocab_size,
            max_context=loaded.max_context, eos_token_ids=loaded.eos_token_ids,
            tokenizer_fingerprint=loaded.tokenizer.fingerprint(), sessions=self.core.session_count(),
            cache_bytes=self.core.store.total_bytes(), cache_budget_bytes=self.core.store.max_bytes,
            forward_costs=self.core.cost_curve.to_pb(), gemm_path=self.core.gemm_path,
            max_batch=self.scheduler.limits.max_batch,
            batching=("one forward per call: " + self.core.ragged_unsupported) if self.core.ragged_unsupported
            else f"ragged, attention {self.core.attention_path}", utilisation=snapshot.utilisation, active_calls=snapshot.active,
            waiting_calls=snapshot.waiting, branch_slots=MAX_BRANCH_SLOTS if self.core.role == "draft" else 0,
            decode_path=self.core.decode_path)

    def close(self) -> None:
        self.scheduler.close()


def add_worker_args(parser: argparse.ArgumentParser, default_model: str) -> None:
    parser.add_argument("--model", default=default_model, help="model ref (tiny:..., embedded:..., dir, .gguf)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", help="write the bound port here once serving")
    parser.add_argument("--cache-budget-mb", type=float, default=2048.0, help="KV cache byte budget")
    parser.add_argument("--session-ttl-s", type=float, default=600.0, help="evict sessions idle this long")
    parser.add_argument("--max-sessions", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto | exact (= float32) | float32 | bfloat16. auto: bf16 on CUDA for "
                        "both roles; on CPU the target stays float32 and the draft uses bf16 where the "
                        "CPU has native bf16; and a CPU draft's GEMM path may also run its one- and "
                        "few-token steps on an int4 copy of its weights (--int4), or for a float32 draft "
                        "on a bf16 copy, where that times faster (an explicit dtype rules both out)")
    parser.add_argument("--calibration-s", type=float, default=20.0,
                        help="startup budget to choose the CPU GEMM path and measure the forward cost curve "
                             "(0 skips both; the k policy then starts from generic defaults); packing the "
                             "chosen weights comes on top (seconds for a 1.5B float32 model)")
    parser.add_argument("--gemm-path", choices=GEMM_PATHS, default="auto",
                        help="auto: each weight shape's GEMM path (F.linear, weight-left, oneDNN-packed weights; "
                             "for a draft under --dtype auto also an int4 or bf16 copy for its fewest-row steps) "
                             "chosen by timing at startup, within half of --calibration-s (0.7 for a draft); library: F.linear "
                             "everywhere, the kernels of HF generate (nearer its numerics), the cost curve still "
                             "measured")
    parser.add_argument("--int4", choices=("auto", "off"), default="auto",
                        help="auto: a CPU draft under --dtype auto may run its fewest-row steps on an int4 copy "
                             "of its weights where that times faster and keeps its token distributions (checked "
                             "at startup against its own full-precision ones); off: no int4 copy. A float32 draft "
                             "on a CPU without native bf16 tries a bf16 copy instead with off, or where the int4 "
                             "copies fail the check or win no timing. Never the target")
    parser.add_argument("--max-k", type=int, default=8,
                        help=f"largest k to calibrate for (the orchestrator's max_k), 1 to {MAX_K}")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="calls (sessions) sharing one forward; 1 runs one call at a time, the exact mode "
                             "(each stream's numerics then do not depend on the others)")
    parser.add_argument("--max-batch-tokens", type=int, default=256, help="token rows per batched forward")
    parser.add_argument("--batch-window-ms", type=float, default=20.0,
                        help="the most a forward waits for calls that are due (sessions that usually come back "
                             "about now) to join it; also at most a tenth of the recent forward time, and never "
                             "when none is due. With --shared-compute: up to the recent forward time, or this if "
                             "longer")
    parser.add_argument("--shared-compute", action="store_true",
                        help="the pair's other worker runs on the same cores (both workers on one CPU, not pinned "
                             "apart): a forward waits up to its own duration for due calls, so that the sessions "
                             "draft together and verify together instead of contending in two alternating groups. "
                             "Leave off where each worker has its own device or cores")
    parser.add_argument("--prefill-chunk", default="auto",
                        help="prompt rows per forward while other calls share it (chunked prefill), so that "
                             "their decode steps are not held up behind whole prompts; 0: whole prompts. auto: "
                             "the most rows that at most double a forward of --max-batch decode rows, or of the "
                             "decode rows beside them where there are more (speculating sessions' verifies), "
                             "from this worker's startup measurement (64 where nothing was measured)")
    parser.add_argument("--prefill-itl-factor", type=float, default=None,
                        help="with --prefill-chunk auto: size each forward's prompt rows so that every stream with a "
                             "decode step in it runs at most this many times as slowly as alone: on the draft its "
                             "step's forward, on the target its verify's forward plus its usual gap between calls (a "
                             "speculating stream drafts in that gap), so the target's forward may cost this factor "
                             "times the step alone plus the gap once less (2 aims at "
                             "inter-token latency under load about twice one stream's); at least 16 rows (also "
                             "where the decode rows alone break the bound); first tokens then come later, as "
                             f"prompts take more forwards. Default {DEFAULT_PREFILL_ITL_FACTOR:g} with --prefill-chunk "
                             "auto (no effect where nothing was measured); 0: off, the budget of --prefill-chunk")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="calls waiting for a batch slot; more are refused with RESOURCE_EXHAUSTED")
    parser.add_argument("--decode-graph", default="auto", choices=DECODE_GRAPH_MODES,
                        help="one-token steps of a session alone in a forward: on, replayed from a CUDA graph "
                             "over a static KV buffer (checked against eager steps at startup, eager where it "
                             "disagrees); static, the same without capture (any device: for checks); off, eager. "
                             "auto: on for the draft on CUDA, else off (the target's greedy output stays "
                             "eager generate's)")
    parser.add_argument("--decode-graph-len", type=int, default=DEFAULT_GRAPH_LEN,
                        help="positions of the decode graph's KV buffer (capped at the model's context); "
                             "longer sessions draft eagerly. Each step attends over all of them")
    parser.add_argument("--hang-timeout-s", type=float, default=600.0,
                        help="a forward with its calls' steps running longer than this (and 10x its expected "
                             "time on the cost curve) is a hung device or kernel: refuse calls and report "
                             "NOT_SERVING, so that the liveness probe restarts the worker (0: off)")
    parser.add_argument("--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    parser.add_argument("--drain-delay-s", type=float, default=0.0,
                        help="on SIGTERM, report NOT_SERVING this long before refusing new calls")
    parser.add_argument("--tls-cert", help="PEM certificate (enables TLS)")
    parser.add_argument("--tls-key", help="PEM private key")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mTLS)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: any)")
    parser.add_argument("--health-port", type=int,
                        help="also serve grpc.health.v1 alone, in plaintext, on this port: for kubelet's grpc "
                             "probes when the API port uses TLS")
    parser.add_argument("--log-level", default="INFO")


def _fixed_prefill_chunk(args: argparse.Namespace) -> int | None:
    """--prefill-chunk as rows (None: auto), with --prefill-itl-factor checked against it; SystemExit
    where either is invalid. Called before the model loads (check_worker_flags) and by batch_limits."""
    chunk = str(args.prefill_chunk)
    rows = None if chunk == "auto" else int(chunk) if chunk.isascii() and chunk.isdigit() else -1
    if rows is not None and rows < 0:
        raise SystemExit(f"--prefill-chunk must be a number of rows (0: off) or auto, got {chunk!r}")
    if args.prefill_itl_factor is not None and (not itl_factor_valid(args.prefill_itl_factor)
                                                or (args.prefill_itl_factor > 0 and rows is not None)):
        raise SystemExit("--prefill-itl-factor must be 0 (off) or >= 1, and needs --prefill-chunk auto "
                         "(a measured cost curve)")
    return rows


def batch_limits(args: argparse.Namespace, cost_curve: CostCurve = CostCurve(), role: str = "target") -> BatchLimits:
    """The scheduler's limits from the worker flags and its startup cost curve. The ITL bound's gap
    relief is the target's alone (BatchLimits.itl_gap_relief)."""
    fixed = _fixed_prefill_chunk(args)
    itl_factor = (args.prefill_itl_factor if args.prefill_itl_factor is not None
                  else DEFAULT_PREFILL_ITL_FACTOR if fixed is None else 0.0)
    curve: tuple[tuple[int, float], ...] = ()  # sizes each forward's prompt budget (auto, measured)
    if fixed is None:
        rows_curve = cost_curve.rows_curve()
        measured = prefill_chunk_for(rows_curve, args.max_batch, args.max_batch_tokens)
        prefill_chunk = AUTO_PREFILL_CHUNK_FALLBACK if measured is None else measured
        curve = () if measured is None else rows_curve
        log.info("prefill chunk: %d rows beside %d decode rows (%s)", prefill_chunk, args.max_batch,
                 "measured; sized per forward against its decode rows" if measured else "nothing measured")
        if itl_factor > 0 and measured is not None:
            log.info("prefill chunk bounded per forward: streams at most %.2fx as slow as alone (%d rows beside "
                     "%d one-row steps with no gap)", itl_factor,
                     prefill_chunk_within(rows_curve, args.max_batch, itl_limit_ms(rows_curve, 1, itl_factor),
                                          args.max_batch_tokens), args.max_batch)
    else:
        prefill_chunk = fixed
    if args.prefill_itl_factor is not None and args.prefill_itl_factor > 0 and not curve:
        log.warning("--prefill-itl-factor %.2f has no effect: no forward of 16 rows or more was measured",
                    args.prefill_itl_factor)
    return BatchLimits(max_batch=args.max_batch, max_batch_tokens=args.max_batch_tokens,
                       window_ms=args.batch_window_ms, max_queue=args.max_queue, prefill_chunk=prefill_chunk,
                       shared_compute=args.shared_compute, prefill_curve=curve,
                       prefill_itl_factor=itl_factor, itl_gap_relief=role == "target")


def _log_watchdog_failure(task: asyncio.Task[None]) -> None:
    """A watchdog that failed would stop watching without a word."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the hang watchdog failed", exc_info=task.exception())


def check_worker_flags(args: argparse.Namespace) -> None:
    """Flags that no worker could start with, refused before the model loads (minutes, for a real one)."""
    if not args.session_ttl_s > 0 or not args.cache_budget_mb > 0 or args.max_sessions < 1:
        raise SystemExit("--session-ttl-s and --cache-budget-mb must be > 0 and --max-sessions >= 1, got "
                         f"{args.session_ttl_s}, {args.cache_budget_mb} and {args.max_sessions}")
    if not (args.hang_timeout_s == 0 or 1.0 <= args.hang_timeout_s < math.inf):  # a forward may take seconds
        raise SystemExit(f"--hang-timeout-s must be 0 (off) or at least 1 second, got {args.hang_timeout_s}")
    if not math.isfinite(args.calibration_s):
        raise SystemExit(f"--calibration-s must be a number of seconds (0 skips), got {args.calibration_s}")
    if not 1 <= args.max_k <= MAX_K:  # a huge one made the calibration run a forward of that many rows
        raise SystemExit(f"--max-k must be in [1, {MAX_K}] (the most drafts a round may verify), got {args.max_k}")
    if args.max_batch < 1 or args.max_batch_tokens < 1 or args.max_queue < 0 or not args.batch_window_ms >= 0:
        raise SystemExit("--max-batch and --max-batch-tokens must be >= 1, --max-queue and --batch-window-ms >= 0; "
                         f"got {args.max_batch}, {args.max_batch_tokens}, {args.max_queue}, {args.batch_window_ms}")
    _fixed_prefill_chunk(args)
    if args.decode_graph_len < 2:
        raise SystemExit(f"--decode-graph-len must be >= 2 positions, got {args.decode_graph_len}")
    from specdec import security
    security.check_tls_flags(args, {"--tls-cert": ("--tls-key",), "--tls-key": ("--tls-cert",),
                                    "--tls-client-ca": ("--tls-cert", "--tls-key")})


def store_limits(args: argparse.Namespace) -> StoreLimits:
    return StoreLimits(max_bytes=int(args.cache_budget_mb * 1024 * 1024), ttl_s=args.session_ttl_s,
                       max_sessions=args.max_sessions)


async def serve_worker(args: argparse.Namespace, role: str,
                       make_servicer: Callable[[WorkerCore, BatchLimits], WorkerServicerBase],
                       register: Callable[[Any, grpc.aio.Server], None], service_name: str) -> None:
    from specdec.models import load_model, reduced_copy_kinds, resolve_device, resolve_dtype, set_torch_threads
    check_worker_flags(args)
    credentials = None
    if args.tls_cert and args.tls_key:  # read and checked before the model loads: a bad path fails in a second
        from specdec import security
        try:
            credentials = security.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
        except security.TlsFilesError as exc:
            raise SystemExit(f"TLS: {exc}") from None
    set_torch_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, role, device)
    try:
        decode_graph = resolve_decode_graph(args.decode_graph, role, device)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    log.info("loading %s model %s (%s on %s)", role, args.model, dtype, device)
    loaded = await asyncio.to_thread(load_model, args.model, dtype, str(device))
    core = WorkerCore(loaded, role, store_limits(args))
    await asyncio.to_thread(calibrate, core, args.max_k, args.calibration_s, args.gemm_path,
                            reduced_copy_kinds(args.dtype, role, device, int4=args.int4 == "auto"))
    # The scheduler sizes prompt chunks against what forwards of several rows cost, which the decode
    # graph does not change: from the eager curve. GetInfo reports the graph's one-token steps.
    limits = batch_limits(args, core.cost_curve, role)
    if decode_graph != "off":
        await asyncio.to_thread(core.enable_decode_graph, decode_graph == "on", args.decode_graph_len)
        if core.decode_graph is not None and args.calibration_s > 0:
            await asyncio.to_thread(retime_decode_steps, core)
    servicer = make_servicer(core, limits)
    handle = await grpc_util.start_server(lambda server: register(servicer, server), [service_name],
                                          host=args.host, port=args.port, credentials=credentials,
                                          health_port=args.health_port)
    loop = asyncio.get_running_loop()
    # A model thread that died serves nothing more: NOT_SERVING, so probes restart the worker and
    # balancers move traffic away (the scheduler, grpc-free, calls this from its thread).
    servicer.scheduler.on_failure(lambda exc: asyncio.run_coroutine_threadsafe(handle.set_serving(False), loop))
    watchdog = (asyncio.create_task(watch_for_a_hung_forward(servicer.scheduler, args.hang_timeout_s,
                                                             lambda _: handle.set_serving(False)))
                if args.hang_timeout_s > 0 else None)
    if watchdog is not None:
        watchdog.add_done_callback(_log_watchdog_failure)
    if args.metrics_port is not None:
        from specdec.metrics import serve_metrics, worker_registry
        serve_metrics(args.metrics_port, worker_registry(core, servicer.scheduler), args.host)
    try:
        await grpc_util.run_until_signalled(handle, args.grace_s, args.port_file, drain_delay_s=args.drain_delay_s)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        servicer.close()
