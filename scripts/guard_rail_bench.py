"""Guard rails, measured: where the pair cannot win, what does the default policy cost against k = 0?

    python scripts/guard_rail_bench.py [--tokens 96] [--reps 3] [--out docs/bench/<cpu>/guard-rails.json]

Three services on 127.0.0.1 (real gRPC), tiny random models whose forwards are slowed by a fixed
sleep so the cost ratios look like a real pair's, and the workers calibrate at startup as in service
(the sleep is inside the model's forward, so calibration sees it). Scenarios where speculation must
lose:
  slow draft       the draft's forward costs 2x the target's
  low acceptance   the draft is an unrelated model (acceptance ~ 0)
  slow draft RTT   each Propose call waits 60 ms, draft compute cheap; GetInfo does not wait, so the
                   orchestrator's startup ping does not see it (the policy must measure it in rounds)
  far draft node   every draft call waits 60 ms (GetInfo, Propose, EndSession): what a network does,
                   so the startup ping sees it
For each: the server's default policy against fixed k = 0, interleaved, in one run; the issue's bar
is a cost of at most 5 %. The report also gives the round index at which the policy first chose 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draft_worker.servicer import SERVICE_NAME as DRAFT_SERVICE, DraftServicer, register as register_draft  # noqa: E402
from orchestrator.app import OrchestratorConfig, start_orchestrator  # noqa: E402
from orchestrator.config import SpeculationConfig  # noqa: E402
from orchestrator.api import EngineLimits  # noqa: E402
from specdec import grpc_util  # noqa: E402
from specdec.calibration import calibrate  # noqa: E402
from specdec.models import load_model  # noqa: E402
from specdec.tools.bench import describe_machine  # noqa: E402
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc  # noqa: E402
from specdec.worker_core import WorkerCore  # noqa: E402
from target_worker.servicer import SERVICE_NAME as TARGET_SERVICE, TargetServicer, register as register_target  # noqa: E402

TARGET_FORWARD_MS = 30.0


@dataclass(frozen=True)
class Scenario:
    name: str
    draft_ref: str
    draft_forward_ms: float
    draft_delay_ms: float = 0.0               # server-side wait before each of these draft calls
    delayed_calls: tuple[str, ...] = ("Propose",)


SCENARIOS = [
    Scenario("slow draft (2x the target per forward)", "tiny:seed=0,noise=0.02", 2 * TARGET_FORWARD_MS),
    Scenario("low acceptance (unrelated draft)", "tiny:seed=7", 3.0),
    Scenario("slow draft RTT (+60 ms per Propose)", "tiny:seed=0,noise=0.02", 3.0, draft_delay_ms=60.0),
    Scenario("far draft node (+60 ms per draft call)", "tiny:seed=0,noise=0.02", 3.0, draft_delay_ms=60.0,
             delayed_calls=("GetInfo", "Propose", "EndSession")),
]


def slow_down(model: torch.nn.Module, ms: float) -> None:
    model.register_forward_pre_hook(lambda module, args: time.sleep(ms / 1000.0))


async def run_scenario(scenario: Scenario, tokens: int, reps: int, calibration_s: float) -> dict:
    target_loaded = load_model("tiny:seed=0")
    draft_loaded = load_model(scenario.draft_ref)
    slow_down(target_loaded.model, TARGET_FORWARD_MS)
    slow_down(draft_loaded.model, scenario.draft_forward_ms)
    target_core, draft_core = WorkerCore(target_loaded, "target"), WorkerCore(draft_loaded, "draft")
    calibrate(target_core, 8, calibration_s)
    calibrate(draft_core, 8, calibration_s)
    draft, target = DraftServicer(draft_core), TargetServicer(target_core)
    if scenario.draft_delay_ms:
        for name in scenario.delayed_calls:
            setattr(draft, name, grpc_util.delayed_call(getattr(draft, name), scenario.draft_delay_ms))
    draft_handle = await grpc_util.start_server(lambda s: register_draft(draft, s), [DRAFT_SERVICE])
    target_handle = await grpc_util.start_server(lambda s: register_target(target, s), [TARGET_SERVICE])
    cfg = OrchestratorConfig(f"127.0.0.1:{draft_handle.port}", f"127.0.0.1:{target_handle.port}", "tiny:seed=0",
                             SpeculationConfig(), EngineLimits(), 4, 16, connect_timeout_s=10.0)
    orch_handle, _, backends = await start_orchestrator(cfg)
    results: dict[str, list[float]] = {"default policy": [], "k=0": []}
    first_zero: list[int] = []
    drafted_share: list[float] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orch_handle.port}") as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            for rep in range(reps):
                order = ["default policy", "k=0"] if rep % 2 == 0 else ["k=0", "default policy"]
                for system in order:
                    req = orchestrator_pb2.GenerateRequest(max_new_tokens=tokens, temperature=0.0)
                    req.prompt_ids.ids.extend([5 + rep, 6, 7, 8])
                    if system == "k=0":
                        req.speculation.fixed_k = 0
                    start = time.perf_counter()
                    reply = await stub.Generate(req, timeout=600)
                    results[system].append(reply.stats.new_tokens / (time.perf_counter() - start))
                    if system == "default policy":
                        ks = list(reply.stats.k_per_round)
                        # The last round's k = 0 can be the token budget's, not the policy's.
                        chosen = ks[:-1]
                        first_zero.append(chosen.index(0) if 0 in chosen else -1)
                        drafted_share.append(sum(1 for k in ks if k) / len(ks))
    finally:
        for backend in backends:
            await backend.close()
        for handle in (orch_handle, draft_handle, target_handle):
            await handle.stop(0)
        draft.close()
        target.close()
    ratios = [a / b for a, b in zip(results["default policy"], results["k=0"])]
    return {"scenario": scenario.name, "tok_s_default": results["default policy"], "tok_s_k0": results["k=0"],
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "first_k0_round": first_zero, "rounds_with_drafts_share": drafted_share}


async def main_async(args: argparse.Namespace) -> None:
    machine = describe_machine()
    rows = [await run_scenario(s, args.tokens, args.reps, args.calibration_s) for s in SCENARIOS]
    header = (f"`python scripts/guard_rail_bench.py {' '.join(sys.argv[1:])}` — "
              f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; {machine['cpu']} ({machine['cpus']} cpus; "
              f"flags {machine['flags']}); {machine['gpu']}; torch {machine['torch']}; target forward "
              f"+{TARGET_FORWARD_MS:.0f} ms (tiny model + sleep)")
    print(header)
    print("\n| scenario | default policy / k=0, median (min–max) | first round at k=0 | rounds that drafted |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['ratio_median']:.3f}x ({r['ratio_min']:.3f}–{r['ratio_max']:.3f}) | "
              f"{r['first_k0_round']} | {statistics.mean(r['rounds_with_drafts_share']):.0%} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "machine": machine, "rows": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--calibration-s", type=float, default=3.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
