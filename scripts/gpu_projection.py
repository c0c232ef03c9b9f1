"""GPU projection for docs/benchmarks.md ("GPU"): a computation, not a measurement.

    python scripts/gpu_projection.py [--host-ms 1.2] [--bandwidth-tbs 3.35] [--efficiency 0.85]
    python scripts/gpu_projection.py --verify-ms 6.97 --draft-ms 2.8     # measured step times

Memory-bound floor per forward = weight bytes read / achievable bandwidth; the draft's one-token step
is bounded below by graph replay of its kernels. `--verify-ms` / `--draft-ms` replace the computed
figures with measured ones (scripts/gpu_costs.py: "graph step ms" on the H200, 2026-11-27).
"""
from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth-tbs", type=float, default=3.35, help="H100 SXM HBM3")
    parser.add_argument("--efficiency", type=float, default=0.85, help="achievable fraction in a GEMV")
    parser.add_argument("--target-params-read", type=float, default=7.62e9 - 0.545e9,
                        help="Qwen2.5-7B; embedding rows are gathered, not read")
    parser.add_argument("--draft-params-read", type=float, default=0.494e9, help="Qwen2.5-0.5B")
    parser.add_argument("--draft-kernels", type=int, default=24 * 14 + 4)
    parser.add_argument("--launch-us", type=float, default=2.5, help="per kernel, in graph replay")
    parser.add_argument("--verify-growth", type=float, default=0.02, help="extra verify cost per drafted token")
    parser.add_argument("--host-ms", type=float, nargs="+", default=[1.2, 2.0], help="per RPC call")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.7, 0.8])
    parser.add_argument("--verify-ms", type=float, help="measured target forward (1 row); replaces the floor")
    parser.add_argument("--draft-ms", type=float, help="measured draft one-token step; replaces the floor")
    args = parser.parse_args()
    bandwidth = args.bandwidth_tbs * 1e12 * args.efficiency
    t_verify = args.verify_ms or args.target_params_read * 2 / bandwidth * 1e3
    t_draft_floor = args.draft_params_read * 2 / bandwidth * 1e3
    t_draft = args.draft_ms or max(t_draft_floor, args.draft_kernels * args.launch_us / 1e3)
    print(f"target forward {t_verify:.2f} ms; draft floor {t_draft_floor:.2f} ms, with graph replay {t_draft:.2f} ms")
    print("| a | host/call | best k | service tok/s | target-only (one step + one host call) | ratio |\n|---|---|---|---|---|---|")
    for host in args.host_ms:
        for a in args.acceptance:
            best = (0, 0.0)
            for k in range(0, 17):
                tokens = (1 - a ** (k + 1)) / (1 - a)
                round_ms = k * t_draft + t_verify * (1 + args.verify_growth * k) + host * (2 if k else 1)
                best = max(best, (k, tokens / round_ms * 1e3), key=lambda kv: kv[1])
            base = 1e3 / (t_verify + host)
            print(f"| {a} | {host} ms | {best[0]} | {best[1]:.0f} | {base:.0f} | {best[1] / base:.2f}x |")


if __name__ == "__main__":
    main()
