"""`specdec netbench`: pipelined against serial rounds and target-only, over an emulated network.

The workers run on disjoint CPU sets (taskset, one torch thread each by default) to emulate two
devices, and the orchestrator adds a one-way delay to every worker call (a gRPC client interceptor;
the traffic stays on 127.0.0.1). For each one-way latency, six systems run the same prompts,
round-robin per prompt, in one run (--systems: a subset, beside the first two):

  target-only            fixed k = 0
  serial                 the server's k policy, rounds one after the other
  pipelined-no-branches  the same policy, the draft drafting round n+1 during round n's verify
                         on the assumption that round n is fully accepted
  pipelined-no-overlap   the same, plus branch pre-drafts for the likeliest rejections
                         (pipeline_branches, the server's default)
  pipelined              the same, plus the prefill overlap's default, "auto": priced per turn
                         (docs/pipelining.md); the default pipelined configuration
  pipelined-overlap      the same, with the prefill overlap on for every turn: a turn's first round
                         runs target-only while the draft prefills the prompt and pre-drafts round 2

Reported per latency: tok/s, ratios, the pre-draft hit rate, the draft time hits saved, and target
capacity (the target's busy fraction: verify compute / wall time). A plot of tok/s against latency.
From the orchestrator's round traces (OUT/rounds-<latency>ms.jsonl), two estimates that explain
the result (netreport.py): the **ceiling** (the serial runs' own rounds with every draft hidden: the
first round as it was, every later round as long as its verify call; not a bound, since pipelined
rounds choose their own k) and the **verify slowdown** (the target's compute per verify at a given k
in pipelined runs, where the draft works beside it, against serial runs, where it is idle; where the
workers are two cores of one chip they share memory bandwidth and caches, which two devices do not).
The pair guard is off (netbench_config): its state is per worker pair, and would carry one
system's measurements into another's rounds. The server pipelines, with the prefill overlap "auto"
(a request can turn it on or off, not ask for "auto"), which the "pipelined" system runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import time
from dataclasses import asdict
from pathlib import Path

from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.tools.netreport import REFERENCES, SYSTEMS, NetRun, attach_rounds, markdown, plot, summarize

ROOT = Path(__file__).resolve().parents[2]


async def _runs(address: str, latency: float, prompts: list[dict], max_new: int, names: list[str],
                repeats: int = 1) -> list[NetRun]:
    import grpc

    from specdec.tools.client import build_request
    from specdec.v1 import orchestrator_pb2_grpc
    runs = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        await stub.Generate(build_request(prompt_ids=prompts[0]["ids"], max_new_tokens=4), timeout=600)  # warm-up
        # Round-robin per prompt (the starting system rotates), pass after pass over the prompts.
        for index, (repeat, prompt) in enumerate((r, p) for r in range(repeats) for p in prompts):
            order = names[index % len(names):] + names[:index % len(names)]
            for name in order:
                req = build_request(prompt_ids=prompt["ids"], max_new_tokens=max_new)
                for key, value in SYSTEMS[name].items():
                    setattr(req.speculation, key, value)
                start = time.perf_counter()
                reply = await stub.Generate(req, timeout=1800)
                wall = time.perf_counter() - start
                s = reply.stats
                runs.append(NetRun(latency, name, prompt["id"], s.new_tokens, wall, s.verify_ms, s.predraft_hits,
                                   s.predraft_misses, s.predraft_saved_ms, list(reply.token_ids),
                                   s.predraft_branch_hits, repeat=repeat))
                print(f"  one-way {latency:g} ms, pass {repeat + 1}, {prompt['id']}, {name}: "
                      f"{runs[-1].tokens_per_s:.2f} tok/s", flush=True)
    return runs

def selected_systems(pattern: str | None) -> list[str]:
    """The systems a --systems regex selects, in SYSTEMS order, with the two references (target-only,
    serial) always; ValueError for a bad regex or one that selects nothing else (bench.matching_names)."""
    from specdec.tools.bench import matching_names
    return list(SYSTEMS) if pattern is None else matching_names(list(SYSTEMS), pattern, REFERENCES)


def netbench_config(base: str | None, out: Path) -> Path:
    """The orchestrator's config for netbench: `base` (or the defaults) with the pair guard off, and
    pipelining on with the prefill overlap "auto", as for workers on different devices (every system
    but "pipelined" sets both per request, SYSTEMS). The guard keeps one state per worker pair, so
    with it on, one system's rounds would decide another's target-only epochs; each system here is
    one stream comparing a way of running rounds."""
    from dataclasses import replace

    from orchestrator.config import SpeculationConfig
    spec = SpeculationConfig.from_toml(base) if base else SpeculationConfig()
    path = out / "orchestrator.toml"
    path.write_text(f"# netbench: {base or 'defaults'}, guard off\n" + replace(spec, guard=False, pipeline=True, overlap_prefill="auto").validate().to_toml())
    return path

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec netbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--latencies-ms", default="0,2,10,25", help="one-way latency per RPC, each direction")
    parser.add_argument("--target-cpus", default="0")
    parser.add_argument("--draft-cpus", default="1")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--prompts", default=str(ROOT / "bench" / "prompts.jsonl"))
    parser.add_argument("--max-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--config", help="orchestrator [speculation] TOML (default for the embedded pair: "
                        "configs/embedded-pair-cpu.toml)")
    parser.add_argument("--calibration-s", type=float, default=20.0,
                        help="each worker's startup measuring budget (the workers' own default; with one "
                        "thread each, 10 s left the GEMM-path plans partial)")
    parser.add_argument("--worker-args", default="",
                        help="more flags for both workers, e.g. \"--decode-graph off\" (one string)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over the prompts at each latency (the spread between passes is reported)")
    parser.add_argument("--systems", default=None,
                        help="regex: run only the systems it matches (target-only and serial, the references, always)")
    parser.add_argument("--smoke", action="store_true", help="tiny random models, 2 prompts, 12 tokens (CI)")
    parser.add_argument("--out", default=str(ROOT / "netbench-out"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    try:
        names = selected_systems(args.systems)
    except ValueError as exc:
        parser.error(str(exc))

    from specdec.models import load_tokenizer
    from specdec.tools.bench import describe_machine
    from specdec.tools.demo import DEFAULT_PAIR_CONFIG, local_services
    if args.smoke:
        args.target, args.draft, args.max_new_tokens, args.max_prompts = \
            "tiny:seed=0", "tiny:seed=0,noise=0.02", 12, 2
    config = args.config
    if config is None and (args.target, args.draft) == (DEFAULT_TARGET, DEFAULT_DRAFT):
        config = str(DEFAULT_PAIR_CONFIG)
    tokenizer = load_tokenizer(args.target)
    prompts = [json.loads(line) for line in open(args.prompts) if line.strip()][:args.max_prompts]
    for p in prompts:
        p["ids"] = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True)
    latencies = [float(x) for x in args.latencies_ms.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: list[NetRun] = []
    orch_config = netbench_config(config, out)
    for latency in latencies:
        orch_args = ["--log-level", "WARNING", "--emulate-one-way-latency-ms", str(latency)]
        orch_args += ["--config", str(orch_config)]
        worker_args = ["--calibration-s", str(args.calibration_s), *shlex.split(args.worker_args)]
        cpu_sets = {"target": args.target_cpus, "draft": args.draft_cpus}
        trace = out / f"rounds-{latency:g}ms.jsonl"
        trace.unlink(missing_ok=True)
        orch_args += ["--trace-file", str(trace)]
        with local_services(args.target, args.draft, args.threads, orch_args, worker_args=worker_args,
                            cpu_sets=cpu_sets, logs_dir=out / f"logs-{latency:g}ms") as address:
            at = asyncio.run(_runs(address, latency, prompts, args.max_new_tokens, names, args.repeats))
        if not attach_rounds(at, trace):
            print(f"  {trace}: sessions do not match the requests; no ceiling or slowdown at {latency:g} ms")
        runs += at
    rows = summarize(runs)
    machine = describe_machine()
    command = "specdec netbench " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    header = (f"`{command}` — {time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))} UTC, "
              f"{time.time() - started:.0f} s; target `{args.target}` on CPUs {args.target_cpus}, draft "
              f"`{args.draft}` on CPUs {args.draft_cpus}, {args.threads} torch thread(s) each; {len(prompts)} "
              f"prompts x {args.max_new_tokens} tokens x {args.repeats} pass(es), greedy; systems: {', '.join(names)}; "
              f"config {config}, pair guard off.\n\nMachine: {machine['cpu']} "
              f"({machine['cpus']} cpus; flags {machine['flags']}); {machine['gpu']}; torch {machine['torch']}.\n")
    plot(rows, out / "netbench.png")
    text = f"# specdec netbench\n\n{header}\n{markdown(rows)}\n![tok/s against latency](netbench.png)\n"
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"command": command, "machine": machine, "rows": rows,
                                                 "runs": [{k: v for k, v in asdict(r).items() if k != "rounds"} for r in runs]}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
