"""gRPC implementations of the worker backends; map grpc status codes to domain errors."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import grpc

from orchestrator.backends import SENT_BYTES, DraftReply, VerifyReply, WorkerDescription
from specdec.errors import (CacheMismatch, CapacityExceeded, DeadlineExceeded, InvalidRequest,
                            SessionNotFound, SpecdecError, WorkerInternalError, WorkerUnavailable)
from specdec.contract import Commit, CostCurve, SamplingConfig
from specdec.grpc_util import CHANNEL_OPTIONS
from specdec.v1 import common_pb2, worker_pb2, worker_pb2_grpc

_ERRORS: dict[grpc.StatusCode, type[SpecdecError]] = {
    grpc.StatusCode.NOT_FOUND: SessionNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: CacheMismatch,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: WorkerUnavailable,
    grpc.StatusCode.CANCELLED: WorkerUnavailable,  # a worker shutting down cancels its calls
}


def _domain_error(role: str, address: str, err: grpc.aio.AioRpcError) -> SpecdecError:
    # Anything else (INTERNAL, UNKNOWN, UNIMPLEMENTED, UNAUTHENTICATED, ...) is a bug or a
    # misconfiguration: retrying will not fix it and the worker is not down.
    cls = _ERRORS.get(err.code(), WorkerInternalError)
    error = cls(f"{role} worker at {address}: {err.code().name}: {err.details()}")
    # A worker's full queue says when to come back; the caller of the orchestrator gets the same hint.
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after-ms" and str(value).isdigit():
            error.retry_after_ms = int(value)  # type: ignore[attr-defined]
    return error


class EmulatedLatency(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds a one-way delay to each direction of every unary call: a network of RTT = 2 x one_way_ms
    on loopback, for benchmarks (the traffic itself stays on 127.0.0.1)."""

    def __init__(self, one_way_ms: float) -> None:
        self.one_way_s = one_way_ms / 1000.0

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        # The caller's deadline covers the emulated network as it would a real one: the call itself
        # gets what is left after both one-way delays (a deadline shorter than the round trip
        # expires at once, as it would).
        if client_call_details.timeout is not None:
            left = client_call_details.timeout - 2 * self.one_way_s
            if left <= 0:
                await asyncio.sleep(client_call_details.timeout)
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), details="Deadline Exceeded (emulated network)")
            client_call_details = client_call_details._replace(timeout=left)
        await asyncio.sleep(self.one_way_s)
        call = await continuation(client_call_details, request)
        try:
            reply = await call
        except grpc.aio.AioRpcError:
            # The error travels back too; a call whose shortened deadline ran out ends here just at
            # the caller's own deadline.
            await asyncio.sleep(self.one_way_s)
            raise
        # (A cancelled call ends at once, as a real one does locally: no return leg. With it, every
        # pre-draft cancelled by a rejection held the next round back by one more one-way delay.)
        await asyncio.sleep(self.one_way_s)
        return reply


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """server_name overrides the name checked against the worker's certificate (pods are dialled by
    IP from DNS discovery, while their certificate names the service)."""
    if credentials is not None:
        options = list(CHANNEL_OPTIONS)
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=list(interceptors))
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=list(interceptors))


class _WorkerClient:
    role = "worker"

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        self.address = address
        self.channel = channel or open_channel(address)
        self._in_flight = 0
        self._idle = asyncio.Event()  # set while no call is in flight (close waits for it)
        self._idle.set()

    async def _call(self, method: Any, request: Any, timeout_s: float | None) -> Any:
        self._in_flight += 1
        self._idle.clear()
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _domain_error(self.role, self.address, err) from err
        except grpc.aio.UsageError as err:  # a call on a channel already closed (its replica left)
            raise WorkerUnavailable(f"{self.role} worker at {self.address}: {err}") from None
        except asyncio.CancelledError:
            # grpc.aio cancels the calls of a channel closed under them and the await raises
            # CancelledError, not an RpcError. Unless our own task is being cancelled (the caller
            # went away), that is the replica going away: the round retries or re-prefills
            # elsewhere, as after UNAVAILABLE, instead of ending the request as if cancelled.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise WorkerUnavailable(f"{self.role} worker at {self.address}: call cancelled (channel closed)") from None
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def end_session(self, session_id: str) -> bool:
        reply = await self._call(self._stub.EndSession, common_pb2.EndSessionRequest(session_id=session_id), 10.0)
        return reply.existed

    async def describe(self, timeout_s: float | None = 30.0) -> WorkerDescription:
        info = await self._call(self._stub.GetInfo, common_pb2.GetInfoRequest(), timeout_s)
        return WorkerDescription(info.role, info.model_ref, info.vocab_size, info.max_context,
                                 list(info.eos_token_ids), info.tokenizer_fingerprint,
                                 CostCurve.from_pb(info.forward_costs), info.branch_slots)

    async def close(self, grace_s: float | None = None) -> None:
        """grace_s: let calls in flight finish for up to that long first (a replica leaving the
        ring); None cancels them (shutdown). The wait is ours, not grpc's close(grace): cancelled
        (the orchestrator shutting down meanwhile), it leaves the channel open for the close that
        follows, where grpc's marks the channel closed before waiting and a later close(None) then
        did nothing, leaving the calls running and the channel open."""
        if grace_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        await self.channel.close()


class GrpcDraftBackend(_WorkerClient):
    role = "draft"

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        super().__init__(address, channel)
        self._stub = worker_pb2_grpc.DraftWorkerStub(self.channel)

    async def propose(self, session_id: str, commit: Commit, k: int, sampling: SamplingConfig,
                      min_draft_prob: float, timeout_s: float | None, slot: int = 0,
                      fork_from: int | None = None) -> DraftReply:
        request = worker_pb2.ProposeRequest(session_id=session_id, commit=commit.to_pb(), k=k,
                                            sampling=sampling.to_pb(), min_draft_prob=min_draft_prob, slot=slot)
        if fork_from is not None:
            request.fork_from = fork_from
        _count_sent(self.role, request)
        start = time.perf_counter()
        reply = await self._call(self._stub.Propose, request, timeout_s)
        return DraftReply(tokens=list(reply.tokens), token_probs=list(reply.token_probs),
                          cache_len=reply.cache_len, compute_ms=reply.timing.compute_ms,
                          prefilled_tokens=reply.timing.prefilled_tokens, q_payload=reply.q,
                          catchup_ms=reply.timing.catchup_ms, draft_steps=reply.timing.draft_steps,
                          confidences=list(reply.confidences),
                          alternatives=list(zip(reply.alt_tokens, reply.alt_probs)), slot=reply.slot,
                          bytes_sent=request.ByteSize(), bytes_received=reply.ByteSize(),
                          wall_ms=(time.perf_counter() - start) * 1000.0)


def _count_sent(role: str, request: Any) -> None:
    if (count := SENT_BYTES.get()) is not None:
        count(role, request.ByteSize())


class GrpcTargetBackend(_WorkerClient):
    role = "target"

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        super().__init__(address, channel)
        self._stub = worker_pb2_grpc.TargetWorkerStub(self.channel)

    async def verify(self, session_id: str, commit: Commit, draft_tokens: list[int], q_payload: Any,
                     sampling: SamplingConfig, timeout_s: float | None) -> VerifyReply:
        request = worker_pb2.VerifyRequest(session_id=session_id, commit=commit.to_pb(),
                                           draft_tokens=draft_tokens, sampling=sampling.to_pb())
        if q_payload is not None and not sampling.greedy:
            request.q.extend(q_payload)
        _count_sent(self.role, request)
        start = time.perf_counter()
        reply = await self._call(self._stub.Verify, request, timeout_s)
        return VerifyReply(accepted_len=reply.accepted_len, next_token=reply.next_token,
                           cache_len=reply.cache_len, compute_ms=reply.timing.compute_ms,
                           prefilled_tokens=reply.timing.prefilled_tokens,
                           bytes_sent=request.ByteSize(), bytes_received=reply.ByteSize(),
                           wall_ms=(time.perf_counter() - start) * 1000.0,
                           batch_sessions=reply.timing.batch_sessions or 1.0, batch_rows=reply.timing.batch_rows,
                           worker_waiting=reply.timing.worker_waiting,
                           batch_prompt_rows=reply.timing.batch_prompt_rows, queue_ms=reply.timing.queue_ms)
