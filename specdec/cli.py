"""`specdec` command: serve-draft, serve-target, serve-orchestrator, generate, demo, fetch-models."""
from __future__ import annotations

import argparse
import asyncio
import sys

COMMANDS = {
    "serve-draft": "run the draft worker",
    "serve-target": "run the target worker",
    "serve-orchestrator": "run the orchestrator",
    "generate": "call an orchestrator (streams the output)",
    "demo": "start all three services locally and stream a generation",
    "bench": "benchmark the service against target-only and HF assisted generation (one run)",
    "loadtest": "bounded load test against an orchestrator (checks every greedy output)",
    "tune": "replay round traces through every k policy and write the best config",
    "netbench": "pipelined vs serial rounds vs target-only, workers on disjoint cores, emulated RPC latency",
    "flips": "how often verifying k+1 positions at once flips a greedy token, per dtype (exactness check)",
    "fetch-models": "download and convert the embedded model pair (part of setup)",
}


def generate_main(argv: list[str]) -> None:
    import grpc

    from specdec.tools.client import build_request, connection, format_stats, stream_generate
    parser = argparse.ArgumentParser(prog="specdec generate")
    parser.add_argument("prompt")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--tls", action="store_true", help="TLS, the server checked against the system's roots")
    parser.add_argument("--tls-ca", help="TLS, the server's certificate checked against this CA (PEM)")
    parser.add_argument("--tls-server-name", help="the name the server's certificate carries (when --address is an IP)")
    parser.add_argument("--auth-token-file", help="send its first token as `authorization: Bearer ...` "
                                                  "(default: $SPECDEC_AUTH_TOKEN, if set)")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--session-id")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--policy")
    parser.add_argument("--fixed-k", type=int)
    parser.add_argument("--min-k", type=int)
    parser.add_argument("--max-k", type=int)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    req = build_request(args.prompt, args.chat, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                        args.seed, args.session_id, args.stop, args.policy, args.fixed_k, args.min_k, args.max_k)
    try:
        via = connection(args.tls, args.tls_ca, args.tls_server_name, args.auth_token_file)
    except (OSError, ValueError) as exc:  # TlsFilesError is a ValueError
        raise SystemExit(f"specdec generate: {exc}") from None
    try:
        stats = asyncio.run(stream_generate(args.address, req, timeout_s=args.timeout_s, via=via))
    except grpc.aio.AioRpcError as err:  # the status, not a traceback
        raise SystemExit(f"\nspecdec generate: {err.code().name}: {err.details()}") from None
    print(format_stats(stats), file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: specdec COMMAND [options]\n\ncommands:")
        for name, help_text in COMMANDS.items():
            print(f"  {name:20s} {help_text}")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    command, rest = argv[0], argv[1:]
    if command == "serve-draft":
        from draft_worker.__main__ import main as run
    elif command == "serve-target":
        from target_worker.__main__ import main as run
    elif command == "serve-orchestrator":
        from orchestrator.__main__ import main as run
    elif command == "demo":
        from specdec.tools.demo import main as run
    elif command == "bench":
        from specdec.tools.bench import main as run
    elif command == "loadtest":
        from specdec.tools.loadtest import main as run
    elif command == "tune":
        from specdec.tools.tune import main as run
    elif command == "netbench":
        from specdec.tools.netbench import main as run
    elif command == "flips":
        from specdec.tools.flips import main as run
    elif command == "fetch-models":
        from specdec.embedded import main as run
    else:
        run = generate_main
    run(rest)


if __name__ == "__main__":
    main()
