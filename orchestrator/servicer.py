"""Orchestrator gRPC servicer: protobuf <-> GenerateParams/GenerationEvent, admission, status codes."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from orchestrator.admission import Admission
from orchestrator.config import SpeculationOverride
from orchestrator.api import GenerateParams, GenerationEvent, GenerationStats
from orchestrator.engine import GenerationEngine
from specdec import grpc_util
from specdec.contract import validate_session_id
from specdec.errors import InvalidRequest, SpecdecError
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name
_FINISH = {
    "length": orchestrator_pb2.FINISH_REASON_LENGTH,
    "stop": orchestrator_pb2.FINISH_REASON_STOP,
    "eos": orchestrator_pb2.FINISH_REASON_EOS,
    "context": orchestrator_pb2.FINISH_REASON_CONTEXT,
}


def params_from_pb(req: orchestrator_pb2.GenerateRequest) -> GenerateParams:
    which = req.WhichOneof("input")
    spec = req.speculation
    override = SpeculationOverride(
        policy=spec.policy if spec.HasField("policy") else None,
        min_k=spec.min_k if spec.HasField("min_k") else None,
        max_k=spec.max_k if spec.HasField("max_k") else None,
        fixed_k=spec.fixed_k if spec.HasField("fixed_k") else None,
        min_draft_prob=spec.min_draft_prob if spec.HasField("min_draft_prob") else None,
        pipeline=spec.pipeline if spec.HasField("pipeline") else None,
        pipeline_branches=spec.pipeline_branches if spec.HasField("pipeline_branches") else None,
        overlap_prefill=spec.overlap_prefill if spec.HasField("overlap_prefill") else None)
    if which is None:
        raise InvalidRequest("exactly one of prompt, prompt_ids or messages is required")
    return GenerateParams(
        prompt=req.prompt if which == "prompt" else None,
        prompt_ids=tuple(req.prompt_ids.ids) if which == "prompt_ids" else None,
        messages=tuple((m.role, m.content) for m in req.messages.messages) if which == "messages" else None,
        session_id=req.session_id if req.HasField("session_id") else None,
        max_new_tokens=req.max_new_tokens, stop=tuple(req.stop),
        temperature=req.temperature if req.HasField("temperature") else 0.0,
        top_k=req.top_k if req.HasField("top_k") else 0,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        seed=req.seed if req.HasField("seed") else None,
        speculation=override, resume_session=req.resume_session)


def stats_to_pb(s: GenerationStats) -> orchestrator_pb2.GenerationStats:
    return orchestrator_pb2.GenerationStats(
        rounds=s.rounds, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
        acceptance_rate=s.acceptance_rate, accepted_per_position=s.accepted_per_position,
        k_per_round=s.k_per_round, accepted_per_round=s.accepted_per_round, draft_ms=s.draft_ms, verify_ms=s.verify_ms, overhead_ms=s.overhead_ms,
        total_ms=s.total_ms, tokens_per_second=s.tokens_per_second, new_tokens=s.new_tokens,
        reprefills=s.reprefills, bytes_to_draft=s.bytes_to_draft, bytes_to_target=s.bytes_to_target,
        seed=s.seed, fallback_rounds=s.fallback_rounds, guard_off_rounds=s.guard_off_rounds,
        prompt_tokens=s.prompt_tokens,
        cached_prompt_tokens=s.cached_prompt_tokens, bytes_from_draft=s.bytes_from_draft,
        bytes_from_target=s.bytes_from_target, predraft_hits=s.predraft_hits,
        predraft_misses=s.predraft_misses, predraft_saved_ms=s.predraft_saved_ms,
        predraft_branch_hits=s.predraft_branch_hits)


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, engine: GenerationEngine, admission: Admission, metrics: Any = None) -> None:
        self.engine = engine
        self.admission = admission
        self.metrics = metrics
        if metrics is not None:  # read at each scrape: EndSession and evictions change it too
            metrics.sessions.set_function(lambda: engine.sessions.named)

    async def _events(self, request: orchestrator_pb2.GenerateRequest,
                      context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[GenerationEvent]:
        started = time.perf_counter()
        code, tokens = "OK", 0
        try:
            params = params_from_pb(request)
            speculation = self.engine.validate(params)  # before admission: a bad request takes no slot
            async with self.admission.slot():
                if self.metrics is not None:
                    self.metrics.inflight.inc()
                try:
                    # aclosing: the turn (its session lock, its pre-draft) ends before the slot is
                    # given back, not when the abandoned generator is collected.
                    async with contextlib.aclosing(self.engine.generate(params, context.time_remaining(),
                                                                        speculation)) as events:
                        async for event in events:
                            tokens += len(event.token_ids)
                            yield event
                finally:
                    if self.metrics is not None:
                        self.metrics.inflight.dec()
        except SpecdecError as exc:
            code = exc.code_name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # gRPC cancels the handler for a deadline that ran out too: the caller saw DEADLINE_EXCEEDED.
            # A stream cancelled while its write was blocked is closed instead (GeneratorExit).
            remaining = context.time_remaining()
            code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            if self.metrics is not None:
                # Tokens returned to callers: a unary call that failed returned none of its own.
                returned = tokens if code == "OK" or method == "GenerateStream" else 0
                self.metrics.request_done(method, code, time.perf_counter() - started, returned)

    # Errors become statuses in one place: grpc_util.add_service.
    async def Generate(self, request: orchestrator_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> orchestrator_pb2.GenerateResponse:
        text, ids = [], []
        final: GenerationEvent | None = None
        # aclosing: a call that ends early closes _events now (its finally: the slot, the metrics),
        # not whenever the abandoned generator is collected.
        async with contextlib.aclosing(self._events(request, context, "Generate")) as events:
            async for event in events:
                text.append(event.text_delta)
                ids.extend(event.token_ids)
                final = event
        assert final is not None and final.stats is not None
        return orchestrator_pb2.GenerateResponse(
            text="".join(text), token_ids=ids, finish_reason=_FINISH[final.finish_reason or "length"],
            stats=stats_to_pb(final.stats), session_id=final.session_id)

    async def GenerateStream(self, request: orchestrator_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[orchestrator_pb2.GenerateStreamResponse]:
        async with contextlib.aclosing(self._events(request, context, "GenerateStream")) as events:
            async for event in events:
                msg = orchestrator_pb2.GenerateStreamResponse(text_delta=event.text_delta, token_ids=event.token_ids,
                                                              session_id=event.session_id)
                if event.finish_reason is not None:
                    msg.finish_reason = _FINISH[event.finish_reason]
                    msg.stats.CopyFrom(stats_to_pb(event.stats or GenerationStats()))
                yield msg

    async def EndSession(self, request: common_pb2.EndSessionRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.EndSessionResponse:
        validate_session_id(request.session_id)
        return common_pb2.EndSessionResponse(existed=await self.engine.end_session(request.session_id))


def register(servicer: OrchestratorServicer, server: grpc.aio.Server) -> None:
    grpc_util.add_service(server, orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"], servicer)
