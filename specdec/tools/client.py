"""Client helpers: build a GenerateRequest, stream it, format the stats (used by the CLI and the demo)."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO

import grpc

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)


def build_request(prompt: str | None = None, chat: bool = False, max_new_tokens: int = 128,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                  session_id: str | None = None, stop: list[str] | None = None, policy: str | None = None,
                  fixed_k: int | None = None, min_k: int | None = None, max_k: int | None = None,
                  prompt_ids: list[int] | None = None) -> orchestrator_pb2.GenerateRequest:
    req = orchestrator_pb2.GenerateRequest(max_new_tokens=max_new_tokens, stop=stop or [])
    if prompt_ids is not None:
        req.prompt_ids.ids.extend(prompt_ids)
    elif chat:
        req.messages.messages.add(role="user", content=prompt or "")
    else:
        req.prompt = prompt or ""
    if temperature > 0:
        req.temperature = temperature
        if top_k:
            req.top_k = top_k
        if top_p < 1.0:
            req.top_p = top_p
    if seed is not None:
        req.seed = seed
    if session_id:
        req.session_id = session_id
    for name, value in (("policy", policy), ("fixed_k", fixed_k), ("min_k", min_k), ("max_k", max_k)):
        if value is not None:
            setattr(req.speculation, name, value)
    return req


@dataclass(frozen=True)
class Connection:
    """How to reach an orchestrator: plaintext, or TLS (credentials, and the name its certificate
    must carry where the address is an IP), and the bearer token its --auth-token-file expects."""
    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None
    token: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, address: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address)
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.aio.secure_channel(address, self.credentials, options=options)


def connection(tls: bool = False, tls_ca: str | None = None, tls_server_name: str | None = None,
               auth_token_file: str | None = None, environ: Mapping[str, str] = os.environ) -> Connection:
    """From the client's flags: TLS with the system's roots (`tls`) or a CA file (`tls_ca`); the token
    from the file's first token line, else $SPECDEC_AUTH_TOKEN (never a flag: argv shows in `ps`)."""
    from specdec import security
    if tls_server_name and not (tls or tls_ca):
        raise ValueError("--tls-server-name needs --tls or --tls-ca")
    credentials = None
    if tls or tls_ca:
        if tls_ca:
            security.check_ca(tls_ca, "--tls-ca")
        credentials = security.channel_credentials(tls_ca)
    token = environ.get("SPECDEC_AUTH_TOKEN") or None
    if auth_token_file:
        token = security.load_tokens(auth_token_file)[0]
    if token and credentials is None:
        log.warning("a bearer token without --tls/--tls-ca crosses the network in plaintext")
    return Connection(credentials, tls_server_name, token)


async def stream_generate(address: str, request: orchestrator_pb2.GenerateRequest, out: TextIO = sys.stdout,
                          timeout_s: float | None = None, via: Connection = Connection()
                          ) -> orchestrator_pb2.GenerationStats:
    async with via.channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        stats = orchestrator_pb2.GenerationStats()
        async for chunk in stub.GenerateStream(request, timeout=timeout_s, metadata=via.metadata or None):
            out.write(chunk.text_delta)
            out.flush()
            if chunk.HasField("stats"):
                stats = chunk.stats
                finish = orchestrator_pb2.FinishReason.Name(chunk.finish_reason)
                out.write(f"\n[finish: {finish}]\n")
        return stats


def format_stats(s: orchestrator_pb2.GenerationStats) -> str:
    per_pos = ", ".join(str(x) for x in s.accepted_per_position) or "-"
    ks = list(s.k_per_round)
    k_summary = f"{min(ks)}..{max(ks)} (mean {sum(ks) / len(ks):.2f})" if ks else "-"
    return "\n".join([
        f"tokens: {s.new_tokens} new ({s.prompt_tokens} prompt, {s.cached_prompt_tokens} cached) in "
        f"{s.total_ms / 1000:.2f}s = {s.tokens_per_second:.2f} tok/s",
        f"rounds: {s.rounds}, k per round: {k_summary}, tokens per round: "
        f"{s.new_tokens / max(1, s.rounds):.2f}",
        f"draft tokens: {s.draft_tokens} proposed, {s.accepted_tokens} accepted "
        f"(acceptance {s.acceptance_rate:.2%}); accepted per position: {per_pos}",
        f"time: draft {s.draft_ms:.0f} ms, verify {s.verify_ms:.0f} ms, orchestrator+gRPC {s.overhead_ms:.0f} ms",
        f"bytes: to draft {s.bytes_to_draft}, to target {s.bytes_to_target}; re-prefills {s.reprefills}; "
        f"fallback rounds {s.fallback_rounds}; seed {s.seed}",
    ])
