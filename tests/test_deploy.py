"""Operating the service: replica routing, discovery, health + reflection, metrics, TLS/mTLS/auth."""
from __future__ import annotations

import asyncio
import datetime
import io
import ipaddress
import re
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.app import OrchestratorConfig, start_orchestrator
from orchestrator.routing import HashRing, ReplicaEjection, ReplicaPool
from specdec import security
from specdec.v1 import common_pb2, orchestrator_pb2_grpc
from tests.stack import Stack, request, start_stack, start_worker
from tests.test_e2e_generate import reference_greedy

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- consistent hashing

async def stop_orchestrator(handle, backends, workers=(), channel=None) -> None:
    """Teardown of a test's orchestrator (its server and its worker channels) and its worker servers."""
    if channel is not None:
        await channel.close()
    for backend in backends:
        await backend.close()
    await handle.stop(0)
    for server, servicer in workers:
        await server.stop(0)
        servicer.close()


def test_ring_spreads_keys_and_moves_few_on_growth() -> None:
    keys = [f"session-{i}" for i in range(4000)]
    ring = HashRing(["a:1", "b:1", "c:1"])
    before = {k: ring.node_for(k) for k in keys}
    shares = {n: sum(1 for v in before.values() if v == n) / len(keys) for n in ring.nodes}
    assert all(0.2 < share < 0.47 for share in shares.values()), shares
    ring.set_nodes(["a:1", "b:1", "c:1", "d:1"])
    moved = [k for k in keys if ring.node_for(k) != before[k]]
    assert 0.15 < len(moved) / len(keys) < 0.35          # ~1/4 move, not everything
    assert all(ring.node_for(k) == "d:1" for k in moved)  # and only to the new replica


async def test_sessions_stick_to_replicas_and_moved_sessions_are_re_prefilled() -> None:
    drafts = [await start_worker("draft", "tiny:seed=0,noise=0.02") for _ in range(2)]
    targets = [await start_worker("target", "tiny:seed=0") for _ in range(3)]
    addr = lambda pair: f"127.0.0.1:{pair[0].port}"  # noqa: E731
    cfg = OrchestratorConfig(",".join(addr(d) for d in drafts), ",".join(addr(t) for t in targets[:2]), "tiny:seed=0",
                             connect_timeout_s=10)
    handle, orch, backends = await start_orchestrator(cfg)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    try:
        sessions = [f"user-{i}" for i in range(16)]
        first = {}
        for sid in sessions:
            prompt = [3, len(sid), 7]
            reply = await stub.Generate(request(prompt_ids=prompt, max_new_tokens=12, session_id=sid,
                                                speculation={"fixed_k": 3}), timeout=60)
            assert list(reply.token_ids) == reference_greedy(prompt, 12)
            first[sid] = (prompt, list(reply.token_ids))
        for pool in (drafts, targets[:2]):
            holders = [set(servicer.core.store._slots) for _, servicer in pool]
            assert all(holders), "every replica should get some sessions"
            assert sum(len(h) for h in holders) == len(sessions)  # each session on exactly one replica
            assert not set.intersection(*holders)
        # Scale the target pool out: few sessions move; a moved session is rebuilt, output unchanged.
        pool = orch.engine.target.pool
        before = {sid: pool.ring.node_for(sid) for sid in sessions}
        pool.set_addresses([addr(t) for t in targets])
        moved = {sid for sid in sessions if pool.ring.node_for(sid) != before[sid]}
        # About a third should move to the new replica; the ports (hence the ring) are random, so
        # with 16 sessions the count varies (binomial): bound it loosely. The ring's own balance is
        # checked with many keys above.
        assert 0 < len(moved) <= 3 * len(sessions) // 4
        for sid in sessions:
            prompt, out = first[sid]
            reply = await stub.Generate(request(prompt_ids=[9, 9], max_new_tokens=8, session_id=sid,
                                                speculation={"fixed_k": 3}), timeout=60)
            assert list(reply.token_ids) == reference_greedy(prompt + out + [9, 9], 8)
            assert (reply.stats.reprefills > 0) == (sid in moved)
        assert set(targets[2][1].core.store._slots) == moved
    finally:
        await stop_orchestrator(handle, backends, drafts + targets, channel)


async def test_a_replica_leaving_the_ring_mid_call_costs_a_re_prefill_not_the_request() -> None:
    """Scale-in or a rollout takes a replica out of the ring while a Verify runs on it. Its channel
    used to be closed at once, which cancels the calls on it (grpc.aio raises CancelledError, not an
    RpcError), and the request failed as if its client had cancelled. Now the channel closes with a
    grace for the calls in flight, and a call cancelled under a caller that is not itself being
    cancelled is UNAVAILABLE: the turn re-prefills on the replica that owns the session now."""
    import threading

    from orchestrator.clients import GrpcTargetBackend
    from specdec.errors import WorkerUnavailable

    draft = await start_worker("draft", "tiny:seed=0,noise=0.02")
    targets = [await start_worker("target", "tiny:seed=0") for _ in range(2)]
    addr = lambda pair: f"127.0.0.1:{pair[0].port}"  # noqa: E731
    cfg = OrchestratorConfig(addr(draft), ",".join(addr(t) for t in targets), "tiny:seed=0", connect_timeout_s=10)
    handle, orch, backends = await start_orchestrator(cfg)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    pool = orch.engine.target.pool
    leaving = targets[0][1]
    in_verify, release = threading.Event(), threading.Event()
    original = leaving.engine.verify_steps

    def held_second_verify(params):  # on the leaving replica's model thread: held until released
        calls[0] += 1
        if calls[0] == 2:
            in_verify.set()
            release.wait(30)
        return (yield from original(params))
    calls = [0]
    leaving.engine.verify_steps = held_second_verify
    failed: list[str] = []
    pool_call = pool.call

    async def recording_call(node, run):
        try:
            return await pool_call(node, run)
        except WorkerUnavailable:
            failed.append(node)
            raise
    pool.call = recording_call
    backend = GrpcTargetBackend(addr(targets[0]))
    try:
        sid = next(f"user-{i}" for i in range(1000) if pool.ring.node_for(f"user-{i}") == addr(targets[0]))
        prompt = [3, 4, 7]
        reply_task = asyncio.ensure_future(stub.Generate(request(prompt_ids=prompt, max_new_tokens=12, session_id=sid,
                                                                 speculation={"fixed_k": 3}), timeout=60))
        assert await asyncio.to_thread(in_verify.wait, 30)
        pool.set_addresses([addr(targets[1])])  # the session's replica leaves mid-Verify
        await asyncio.sleep(0.2)  # its channel is closing by now
        release.set()
        reply = await reply_task
        assert list(reply.token_ids) == reference_greedy(prompt, 12)
        assert reply.stats.reprefills >= 1 and sid in targets[1][1].core.store._slots
        assert failed == []  # the Verify in flight finished on the leaving replica: no retry

        # A channel closed with no grace (shutdown) under a call: UNAVAILABLE to the round, not a cancel.
        calls[0] = 1
        in_verify.clear()
        release.clear()
        from specdec.contract import Commit, SamplingConfig
        call = asyncio.create_task(backend.verify("other", Commit(0, 0, (5, 6, 7)), [], None, SamplingConfig(), 30))
        assert await asyncio.to_thread(in_verify.wait, 30)
        await backend.close()
        with pytest.raises(WorkerUnavailable, match="channel closed"):
            await call
        with pytest.raises(WorkerUnavailable, match="closed"):  # and a call on the closed channel
            await backend.verify("other", Commit(0, 0, (5,)), [], None, SamplingConfig(), 30)
    finally:
        release.set()
        await backend.close()
        await stop_orchestrator(handle, backends, [draft] + targets, channel)


async def test_first_answer_goes_on_when_a_replica_leaves_between_tries() -> None:
    """A DNS refresh can drop a replica while first_answer (startup, GetInfo) waits on the one before
    it: the next try answers UNAVAILABLE for the replica that left (a KeyError crashed startup), and
    the one after answers."""
    from specdec.errors import WorkerUnavailable
    pool = ReplicaPool("target", "a:1,b:1,c:1", lambda address: address)
    tried: list[str] = []

    async def run(backend: str) -> str:
        tried.append(backend)
        if backend == "a:1":
            pool.set_addresses(["a:1", "c:1"])  # b:1 leaves while a:1 is being tried
            raise WorkerUnavailable("a:1 is down")
        return backend
    assert await pool.first_answer(run) == "c:1"
    assert tried == ["a:1", "c:1"]
    await pool.close()


async def test_dns_discovery_resolves_replicas() -> None:
    handle, servicer = await start_worker("target", "tiny:seed=0")
    pool = ReplicaPool("target", f"dns:///localhost:{handle.port}", lambda a: a, refresh_s=0.1)
    try:
        await pool.start()
        assert f"127.0.0.1:{handle.port}" in pool.backends
        assert pool.node_for("any-session") in pool.backends
        from orchestrator.routing import parse_targets, resolve
        assert await resolve("[::1]:7") == ["[::1]:7"]  # an IPv6 literal, bracketed as gRPC wants it
        assert parse_targets("dns:///workers:50051\n") == ([], "workers:50051")  # a ConfigMap's newline
        assert parse_targets("[::1]:1,[::2]:2") == (["[::1]:1", "[::2]:2"], None)
        for typo in ("worker", "worker:0", "worker:99999", "a:1,worker", ":50051", "worker:port", "::1"):
            with pytest.raises(ValueError, match="HOST:PORT"):  # refused at once, not after the connect timeout
                parse_targets(typo)
    finally:
        await pool.close()
        await handle.stop(0)
        servicer.close()


# ----------------------------------------------------------------------------- health, reflection, metrics

def list_services(address: str, credentials: grpc.ChannelCredentials | None = None) -> set[str]:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


async def test_health_and_reflection_on_all_services(stack) -> None:
    for handle, service in ((stack.orch_handle, "specdec.v1.Orchestrator"),
                            (stack.draft_handle, "specdec.v1.DraftWorker"),
                            (stack.target_handle, "specdec.v1.TargetWorker")):
        address = f"127.0.0.1:{handle.port}"
        services = await asyncio.to_thread(list_services, address)
        assert {service, "grpc.health.v1.Health"} <= services
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_servers_accept_the_clients_keepalive_pings_on_idle_connections() -> None:
    """Clients ping every keepalive_time_ms with no call in flight; servers kept gRPC's default policy
    (5 minutes between pings without data) and after two early pings sent GOAWAY "too_many_pings".
    Here with the keepalive interval scaled from 30 s to 1 s on both ends."""
    from specdec import grpc_util
    keepalive_ms = 1000
    handle = await grpc_util.start_server(lambda server: None, [], keepalive_ms=keepalive_ms)
    options = [(k, keepalive_ms if k == "grpc.keepalive_time_ms" else v) for k, v in grpc_util.CHANNEL_OPTIONS]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}", options=options) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            states = []
            for _ in range(7):  # 7 ping intervals idle: with the default policy it dropped after about 4.5
                await asyncio.sleep(keepalive_ms / 1000)
                states.append(channel.get_state())
            assert set(states) == {grpc.ChannelConnectivity.READY}, states
    finally:
        await handle.stop(0)


async def metrics_orchestrator(stack: Stack) -> tuple[Any, Any]:
    """start_stack's orchestrator has no metrics port: a second one with one, on the same workers."""
    cfg = OrchestratorConfig(f"127.0.0.1:{stack.draft_handle.port}", f"127.0.0.1:{stack.target_handle.port}",
                             "tiny:seed=0", metrics_port=0, connect_timeout_s=10)
    handle, _, backends = await start_orchestrator(cfg)
    return handle, backends


async def scrape(port: int) -> str:
    return await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


async def test_prometheus_metrics() -> None:
    from prometheus_client import generate_latest

    from specdec.metrics import worker_registry
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02")
    handle, backends = await metrics_orchestrator(stack)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            await stub.Generate(request(prompt_ids=[1, 2, 3], max_new_tokens=20, speculation={"fixed_k": 3}))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Generate(request(prompt="", max_new_tokens=5))
            await stub.Generate(request(prompt_ids=[4, 5], max_new_tokens=2, session_id="kept"))
            assert "specdec_sessions 1.0" in await scrape(handle.metrics_port)
            await stub.EndSession(common_pb2.EndSessionRequest(session_id="kept"))
            assert "specdec_sessions 0.0" in await scrape(handle.metrics_port)  # was set at a Generate's end only
        body = await scrape(handle.metrics_port)
        assert 'specdec_requests_total{code="OK",method="Generate"} 2.0' in body
        assert 'specdec_requests_total{code="INVALID_ARGUMENT",method="Generate"} 1.0' in body
        assert "specdec_generated_tokens_total 22.0" in body
        rounds = float(re.search(r"^specdec_rounds_total (\S+)", body, re.M).group(1))
        assert rounds >= 5
        for name in ("specdec_draft_tokens_total", "specdec_accepted_tokens_total", 'specdec_round_k_bucket{le="3.0"}',
                     "specdec_acceptance_rate", 'specdec_round_duration_seconds_count{part="verify"}',
                     "specdec_fallback_rounds_total", "specdec_reprefills_total", "specdec_request_duration_seconds"):
            assert name in body, name
        worker_body = generate_latest(worker_registry(stack.target.core, stack.target.scheduler)).decode()
        for name in ('specdec_worker_sessions{role="target"}', "specdec_worker_cache_bytes",
                     "specdec_worker_fed_tokens_total", "specdec_worker_evictions_total"):
            assert name in worker_body, name
        # Every metric the docs name is one a query can find: a sample, or a histogram's family name
        # (adaptive-k.md once named the counter specdec_guard_rounds, which PromQL finds nothing for).
        exported = set(re.findall(r"^# TYPE (\S+)", body + worker_body, re.M))
        exported |= set(re.findall(r"^(specdec_\w+)", body + worker_body, re.M))
        for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
            for name in set(re.findall(r"\bspecdec_[a-z_]*[a-z]\b", doc.read_text())):
                assert name in exported, f"{doc.name} names {name}, which no /metrics exports"
    finally:
        await stop_orchestrator(handle, backends)
        await stack.close()


async def test_a_deadline_that_runs_out_is_counted_as_deadline_exceeded() -> None:
    """gRPC cancels the handler when the caller's deadline runs out during a worker call: the caller
    sees DEADLINE_EXCEEDED, and the metrics counted CANCELLED."""
    stack = await start_stack(target_call_delay_ms=150.0)
    handle, backends = await metrics_orchestrator(stack)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            for timeout in (0.1, 0.2):
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await stub.Generate(request(prompt_ids=[1, 2, 3], max_new_tokens=50), timeout=timeout)
                assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        body = ""
        for _ in range(100):  # counted when the server has ended the handler
            body = await scrape(handle.metrics_port)
            if 'specdec_requests_total{code="DEADLINE_EXCEEDED",method="Generate"} 2.0' in body:
                break
            await asyncio.sleep(0.1)
        assert 'specdec_requests_total{code="DEADLINE_EXCEEDED",method="Generate"} 2.0' in body
        assert 'code="CANCELLED"' not in body
    finally:
        await stop_orchestrator(handle, backends)
        await stack.close()


# ----------------------------------------------------------------------------- TLS, mTLS, bearer auth

def make_pki(tmp: Path) -> dict[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def write(name: str, obj) -> str:
        path = tmp / name
        if hasattr(obj, "private_bytes"):
            path.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        else:
            path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        return str(path)

    ca_key = key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specdec test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    out = {"ca": write("ca.pem", ca)}
    for name, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        k = key()
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"specdec-{name}")]))
                .issuer_name(ca_name).public_key(k.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.DNSName("specdec-worker"),
                                                            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        out[f"{name}_cert"], out[f"{name}_key"] = write(f"{name}.pem", cert), write(f"{name}.key", k)
    return out


async def test_tls_public_api_mtls_workers_and_bearer_auth(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    def worker_creds() -> grpc.ServerCredentials:  # one per server: grpc hands the initial certificate to one only
        return security.server_credentials(pki["server_cert"], pki["server_key"], client_ca=pki["ca"])
    draft = await start_worker("draft", "tiny:seed=0", credentials=worker_creds())
    target = await start_worker("target", "tiny:seed=0", credentials=worker_creds())
    cfg = OrchestratorConfig(f"127.0.0.1:{draft[0].port}", f"127.0.0.1:{target[0].port}", "tiny:seed=0",
                             tls_cert=pki["server_cert"], tls_key=pki["server_key"], auth_tokens=("s3cret",),
                             worker_ca=pki["ca"], worker_client_cert=pki["client_cert"],
                             worker_client_key=pki["client_key"], worker_server_name="specdec-worker",
                             connect_timeout_s=10)
    handle, orch, backends = await start_orchestrator(cfg)
    client_creds = grpc.ssl_channel_credentials(root_certificates=Path(pki["ca"]).read_bytes())
    try:
        async with grpc.aio.secure_channel(f"localhost:{handle.port}", client_creds) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            ok = await stub.Generate(request(prompt_ids=[1, 2, 3], max_new_tokens=8),
                                     metadata=(("authorization", "Bearer s3cret"),), timeout=30)
            assert list(ok.token_ids) == reference_greedy([1, 2, 3], 8)
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(request(prompt_ids=[1], max_new_tokens=2), metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.GenerateStream(request(prompt_ids=[1], max_new_tokens=2), timeout=10):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
        # `specdec generate --tls-ca ... --auth-token-file ...`: the client's side of the same.
        from specdec.tools import client
        token_file = tmp_path / "token"
        token_file.write_text("# the client sends the first\ns3cret\nolder\n")
        via = client.connection(tls_ca=pki["ca"], tls_server_name="localhost", auth_token_file=str(token_file),
                                environ={})
        out = io.StringIO()
        stats = await client.stream_generate(f"127.0.0.1:{handle.port}", request(prompt_ids=[1, 2, 3], max_new_tokens=8),
                                             out=out, timeout_s=30, via=via)
        assert stats.new_tokens == 8 and "FINISH_REASON_LENGTH" in out.getvalue()
        assert client.connection(tls_ca=pki["ca"], environ={"SPECDEC_AUTH_TOKEN": "s3cret"}).token == "s3cret"
        with pytest.raises(grpc.aio.AioRpcError) as err:  # TLS without the token
            await client.stream_generate(f"localhost:{handle.port}", request(prompt_ids=[1], max_new_tokens=2),
                                         out=io.StringIO(), timeout_s=10, via=client.connection(tls_ca=pki["ca"], environ={}))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Plaintext to the TLS API fails; a worker refuses a client without a certificate (mTLS).
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await orchestrator_pb2_grpc.OrchestratorStub(plain).Generate(request(prompt_ids=[1], max_new_tokens=2),
                                                                             timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        no_cert = grpc.ssl_channel_credentials(root_certificates=Path(pki["ca"]).read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{target[0].port}", no_cert) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_orchestrator(handle, backends, (draft, target))


def test_no_pickle_on_the_wire_or_in_weight_loading() -> None:
    sources = [p for pkg in ("specdec", "draft_worker", "target_worker", "orchestrator")
               for p in (ROOT / pkg).rglob("*.py") if "/v1/" not in str(p)]
    for path in sources:
        text = path.read_text()
        assert "import pickle" not in text and "torch.load(" not in text, path
    models = (ROOT / "specdec" / "models.py").read_text()
    assert '"use_safetensors": None if gguf else True' in models


async def test_one_dead_draft_replica_does_not_stop_speculation_elsewhere() -> None:
    drafts = [await start_worker("draft", "tiny:seed=0,noise=0.01") for _ in range(2)]
    target = await start_worker("target", "tiny:seed=0")
    cfg = OrchestratorConfig(",".join(f"127.0.0.1:{h.port}" for h, _ in drafts), f"127.0.0.1:{target[0].port}",
                             "tiny:seed=0", connect_timeout_s=10)
    handle, orch, backends = await start_orchestrator(cfg)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    try:
        dead = f"127.0.0.1:{drafts[0][0].port}"
        await drafts[0][0].stop(0)
        pool = orch.engine.draft.pool
        on_dead = next(f"s{i}" for i in range(100) if pool.ring.node_for(f"s{i}") == dead)
        on_live = next(f"s{i}" for i in range(100) if pool.ring.node_for(f"s{i}") != dead)
        hit = await stub.Generate(request(prompt_ids=[1, 2], max_new_tokens=12, session_id=on_dead,
                                          speculation={"fixed_k": 3}), timeout=30)
        assert hit.stats.fallback_rounds > 0 and list(hit.token_ids) == reference_greedy([1, 2], 12)
        assert orch.engine.draft_degraded
        fine = await stub.Generate(request(prompt_ids=[1, 2], max_new_tokens=12, session_id=on_live,
                                           speculation={"fixed_k": 3}), timeout=30)
        assert fine.stats.fallback_rounds == 0 and fine.stats.draft_tokens > 0  # the other replica still drafts
    finally:
        await stop_orchestrator(handle, backends, drafts + [target], channel)


def test_a_replica_failing_for_a_second_is_passed_over_for_a_cool_down() -> None:
    now = [0.0]
    ejection = ReplicaEjection(clock=lambda: now[0])
    for t in (0.0, 0.2, 0.5):  # a blip: every session's call fails at once, then within the second
        now[0] = t
        ejection.failed("a")
    assert not ejection.passed_over("a")
    now[0] = 1.2
    ejection.failed("a")
    assert ejection.passed_over("a") and not ejection.passed_over("b")
    now[0] = 6.3
    assert not ejection.passed_over("a")  # back after 5 s: its sessions try it again
    ejection.failed("a")  # still down: passed over at once, for twice as long
    now[0] = 16.0
    assert ejection.passed_over("a")
    now[0] = 16.4
    ejection.succeeded("a")
    ejection.failed("a")
    assert not ejection.passed_over("a")  # a success cleared it: a new streak starts
    now[0] = 30.0
    ejection.failed("a")  # 13.6 s later, no calls between (an idle replica): another blip, not the same
    assert not ejection.passed_over("a")
    # A call that hung until the orchestrator's timeout failed for all that time: on a quiet replica
    # such timeouts end minutes apart (each a new blip), and the replica was never passed over.
    for t, cooldown in ((100.0, 5.0), (700.0, 10.0), (1300.0, 20.0)):  # back to back: one streak, doubling
        now[0] = t
        assert not ejection.passed_over("h")
        ejection.failed("h", lasted_s=600.0)
        now[0] = t + cooldown - 0.1
        assert ejection.passed_over("h")
        now[0] = t + cooldown

    ring = HashRing(["a", "b", "c"])
    keys = [f"k{i}" for i in range(200)]
    on_a = [k for k in keys if ring.node_for(k) == "a"]
    assert on_a and all(ring.node_for(k, lambda node: node == "a") in ("b", "c") for k in on_a)
    assert all(ring.node_for(k, lambda node: node == "a") == ring.node_for(k) for k in keys if k not in on_a)
    assert ring.node_for(on_a[0], lambda node: True) == "a"  # all passed over: the owner


async def test_replicas_in_use_are_all_of_them_when_every_one_is_passed_over() -> None:
    # The draft health entry counts the replicas in use: with the only draft passed over, an empty
    # set turned it back to SERVING while every round still went to that dead replica.
    pool = ReplicaPool("draft", "10.0.0.1:1,10.0.0.2:1", lambda address: address)
    now = [0.0]
    pool.ejection = ReplicaEjection(clock=lambda: now[0])
    for t in (0.0, 1.2):
        now[0] = t
        pool.ejection.failed("10.0.0.1:1")
    assert pool.in_use() == {"10.0.0.2:1"}
    for t in (1.3, 2.5):
        now[0] = t
        pool.ejection.failed("10.0.0.2:1")
    assert pool.in_use() == {"10.0.0.1:1", "10.0.0.2:1"}


async def test_a_dead_replica_of_a_static_list_is_routed_around_from_startup_on() -> None:
    """--target with two replicas, the first (as sorted) dead from the start: the orchestrator starts,
    and a session hashed to the dead one is served by the other after the second it takes to pass it
    over (a re-prefill there), token for token as the target alone."""
    dead = "127.0.0.1:1"  # nobody listens; first in sorted order, as startup used to ask only that one
    draft = await start_worker("draft", "tiny:seed=0,noise=0.01")
    live = await start_worker("target", "tiny:seed=0")
    targets = [f"127.0.0.1:{live[0].port}", dead]
    cfg = OrchestratorConfig(f"127.0.0.1:{draft[0].port}", ",".join(targets), "tiny:seed=0", connect_timeout_s=10)
    handle, orch, backends = await start_orchestrator(cfg)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    try:
        ring = orch.engine.target.pool.ring
        assert ring.nodes[0] == dead
        on_dead = next(f"s{i}" for i in range(100) if ring.node_for(f"s{i}") == dead)
        reply = await stub.Generate(request(prompt_ids=[1, 2], max_new_tokens=12, session_id=on_dead,
                                            speculation={"fixed_k": 3}), timeout=30)
        assert list(reply.token_ids) == reference_greedy([1, 2], 12)
        assert orch.engine.target.node_for(on_dead) != dead
    finally:
        await stop_orchestrator(handle, backends, (draft, live), channel)


def test_bearer_scheme_is_case_insensitive_and_any_authorization_value_may_carry_the_token() -> None:
    from specdec.security import BearerTokenInterceptor
    auth = BearerTokenInterceptor(["s3cret"])
    assert auth._authorized((("authorization", "bearer s3cret"),))  # RFC 7235: the scheme is case-insensitive
    assert auth._authorized((("authorization", "BEARER  s3cret "),))
    assert auth._authorized((("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")))
    for refused in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),),
                    (("authorization", "Basic s3cret"),), (("authorization", "Bearer"),)):
        assert not auth._authorized(refused), refused


def test_per_pair_state_keeps_the_pairs_in_use() -> None:
    """Guards, priors and draft health per replica (pair) are bounded; the pair used on every
    request was dropped like any other once 1,024 newer ones had come (its learning reset)."""
    from orchestrator.routing import MAX_REPLICA_ENTRIES, bounded_entry
    entries: dict[str, object] = {}
    hot = bounded_entry(entries, "hot", object)
    for i in range(3 * MAX_REPLICA_ENTRIES):
        bounded_entry(entries, f"pair{i}", object)
        assert bounded_entry(entries, "hot", object) is hot
    assert len(entries) == MAX_REPLICA_ENTRIES and "pair0" not in entries


async def test_a_plaintext_health_port_answers_kubelets_probes_beside_an_mtls_api(tmp_path: Path) -> None:
    """kubelet's grpc probes speak plaintext: with TLS on the API port (mTLS on a worker's) they
    failed and the pods never became Ready. --health-port serves grpc.health.v1 alone, in plaintext,
    with the same statuses; the API stays behind its credentials."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec import grpc_util
    pki = make_pki(tmp_path)
    creds = security.server_credentials(pki["server_cert"], pki["server_key"], client_ca=pki["ca"])
    handle = await grpc_util.start_server(lambda server: None, ["specdec.v1.TargetWorker"], credentials=creds,
                                          health_port=0)
    assert handle.health_port and handle.health_port != handle.port

    async def check(port: int, service: str = "") -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                   timeout=5)
            return reply.status
    try:
        assert await check(handle.health_port) == health_pb2.HealthCheckResponse.SERVING
        assert await check(handle.health_port, "specdec.v1.TargetWorker") == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):  # plaintext on the API port: refused
            await check(handle.port)
        await handle.set_status("", False)  # a failed model thread: the probe sees it
        assert await check(handle.health_port) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await handle.stop(grace_s=0.1)
    with pytest.raises(grpc.aio.AioRpcError):
        await check(handle.health_port)


def _ipv6_loopback() -> bool:
    import socket
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_host_port_brackets_ipv6_literals() -> None:
    from specdec.grpc_util import bare_host, host_port
    assert host_port("0.0.0.0", 50051) == "0.0.0.0:50051"
    assert host_port("::", 50051) == "[::]:50051"  # ":::50051" bound nothing: --host :: failed
    assert host_port("[::1]", 0) == "[::1]:0"
    assert bare_host("[::1]") == "::1" and bare_host("::") == "::" and bare_host("10.0.0.1") == "10.0.0.1"
    assert host_port("worker.svc", 7) == "worker.svc:7"


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback to bind")
async def test_servers_bind_an_ipv6_host() -> None:
    """--host :: (dual-stack clusters) or ::1: the API, the plaintext health port and /metrics bind it."""
    from prometheus_client import CollectorRegistry

    from specdec import grpc_util
    from specdec.metrics import serve_metrics
    handle = await grpc_util.start_server(lambda server: None, ["specdec.v1.TargetWorker"], host="::1", health_port=0)
    try:
        for port in (handle.port, handle.health_port):
            async with grpc.aio.insecure_channel(f"[::1]:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await handle.stop(grace_s=0.1)
    for host in ("::1", "[::1]"):  # --host with or without brackets
        port = serve_metrics(0, CollectorRegistry(), host)
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200


def _install(files: dict[str, str], live: Path) -> None:
    """Replace the live files by rename, as a Kubernetes secret volume's symlink swap does."""
    for name, source in files.items():
        tmp = live / f".{name}.tmp"
        tmp.write_bytes(Path(source).read_bytes())
        tmp.replace(live / name)


async def test_a_rotated_server_certificate_is_served_to_new_connections_without_a_restart(tmp_path: Path,
                                                                                           caplog) -> None:
    """cert-manager renews a certificate by replacing the secret's files: new connections get the new
    one; a half-replaced set (a key not of its certificate) is refused with a warning and the
    current one kept."""
    from specdec import grpc_util
    for name in ("old", "new", "live"):
        (tmp_path / name).mkdir()
    old, new, live = make_pki(tmp_path / "old"), make_pki(tmp_path / "new"), tmp_path / "live"
    _install({"tls.crt": old["server_cert"], "tls.key": old["server_key"]}, live)
    files = security.ServerCertificateFiles(str(live / "tls.crt"), str(live / "tls.key"), check_interval_s=0.0)
    handle = await grpc_util.start_server(lambda server: None, ["specdec.v1.TargetWorker"],
                                          credentials=files.credentials())

    async def serving(pki: dict[str, str]) -> bool:
        creds = security.channel_credentials(pki["ca"])
        async with grpc.aio.secure_channel(f"127.0.0.1:{handle.port}", creds) as channel:  # a new connection
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                return True
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                return False
    try:
        assert await serving(old) and not await serving(new)
        _install({"tls.crt": new["server_cert"]}, live)  # half-way: the new certificate, the old key
        with caplog.at_level("WARNING", logger="specdec.security"):
            assert await serving(old) and not await serving(new)
        assert "not usable" in caplog.text and files.reloads == 0
        _install({"tls.key": new["server_key"]}, live)
        assert await serving(new) and not await serving(old)
        assert files.reloads == 1
    finally:
        await handle.stop(grace_s=0.1)


def test_bad_tls_files_stop_a_service_at_startup_with_the_reason(tmp_path: Path) -> None:
    """Checked before a worker loads its model (minutes for a large one): a wrong path, a file that
    is not PEM, or a key of another certificate, each named."""
    import argparse

    from orchestrator.app import add_args, config_from_args
    (tmp_path / "o").mkdir()
    pki, other = make_pki(tmp_path), make_pki(tmp_path / "o")
    (tmp_path / "junk.pem").write_text("not a certificate")
    labelled = tmp_path / "labelled-ca.pem"  # curl's cacert.pem has UTF-8 labels between certificates
    labelled.write_bytes("# Certificat racine éprouvé\n".encode() + Path(pki["ca"]).read_bytes())
    security.check_tls_files(client=(str(labelled), None, None))
    security.check_tls_files((pki["server_cert"], pki["server_key"], pki["ca"]),
                             (pki["ca"], pki["client_cert"], pki["client_key"]))  # a good set passes
    for server, client, match in (
            ((str(tmp_path / "nope.pem"), pki["server_key"], None), (None, None, None), "--tls-cert .*nope.pem"),
            ((str(tmp_path / "junk.pem"), pki["server_key"], None), (None, None, None), "not a PEM file"),
            ((pki["server_cert"], other["server_key"], None), (None, None, None), "--tls-key"),
            ((pki["server_cert"], pki["server_key"], str(tmp_path / "junk.pem")), (None, None, None), "--tls-client-ca"),
            ((None, None, None), (str(tmp_path / "nope.pem"), None, None), "--worker-ca"),
            ((None, None, None), (pki["ca"], pki["client_cert"], other["client_key"]), "--worker-client-key")):
        with pytest.raises(SystemExit, match=match):
            security.check_tls_files(server, client)
    parser = argparse.ArgumentParser()
    add_args(parser)
    base = ["--draft", "127.0.0.1:1", "--target", "127.0.0.1:2"]
    for flags, match in ((["--tls-cert", pki["server_cert"], "--tls-key", other["server_key"]], "TLS: --tls-cert"),
                         (["--auth-token-file", str(tmp_path / "none.txt")], "--auth-token-file")):
        with pytest.raises(SystemExit, match=match):
            config_from_args(parser.parse_args(base + flags))


async def test_metrics_count_a_stream_closed_mid_write_as_cancelled_and_a_failed_call_returns_no_tokens() -> None:
    """grpc.aio closes a streaming handler whose client cancelled while a write was blocked
    (GeneratorExit, not CancelledError): it was counted code="OK". A unary call that failed after
    some tokens returned none, yet they were counted as returned to callers."""
    from types import SimpleNamespace

    from orchestrator import servicer as orch_servicer
    from orchestrator.admission import Admission
    from orchestrator.api import GenerationEvent
    from orchestrator.metrics import OrchestratorMetrics
    from specdec.errors import WorkerUnavailable
    from specdec.v1 import orchestrator_pb2

    class Engine:
        sessions = SimpleNamespace(named=0)

        def validate(self, params: Any) -> None:
            return None

        async def generate(self, params: Any, time_remaining: Any, speculation: Any) -> Any:
            for _ in range(3):
                yield GenerationEvent("x", [1])
            raise WorkerUnavailable("target down")

    metrics = OrchestratorMetrics()
    servicer = orch_servicer.OrchestratorServicer(Engine(), Admission(2, 2), metrics)
    context = SimpleNamespace(time_remaining=lambda: None)
    stream = servicer._events(orchestrator_pb2.GenerateRequest(prompt="hi", max_new_tokens=4), context, "GenerateStream")
    await stream.__anext__()
    await stream.aclose()  # what grpc.aio does to a stream cancelled mid-write
    sample = metrics.registry.get_sample_value
    assert sample("specdec_requests_total", {"method": "GenerateStream", "code": "CANCELLED"}) == 1.0
    assert sample("specdec_requests_total", {"method": "GenerateStream", "code": "OK"}) is None
    with pytest.raises(WorkerUnavailable):
        await servicer.Generate(orchestrator_pb2.GenerateRequest(prompt="hi", max_new_tokens=4), context)
    assert sample("specdec_requests_total", {"method": "Generate", "code": "UNAVAILABLE"}) == 1.0
    assert sample("specdec_generated_tokens_total") == 1.0  # the stream's one token, none of the failed call's
    assert servicer.admission.running == 0
