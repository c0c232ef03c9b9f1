"""protobuf <-> dataclass conversion shared by the servicers and the orchestrator's worker clients."""
from __future__ import annotations

import torch

from specdec.sampling import SamplingConfig, SparseDist
from specdec.v1 import common_pb2, worker_pb2
from specdec.worker_core import CallStats, Commit


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingConfig:
    return SamplingConfig(temperature=msg.temperature, top_k=msg.top_k,
                          top_p=msg.top_p if msg.top_p > 0 else 1.0, seed=msg.seed)


def sampling_to_pb(cfg: SamplingConfig) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                     seed=cfg.seed)


def commit_from_pb(msg: common_pb2.CacheCommit) -> Commit:
    return Commit(cache_len=msg.cache_len, prefix_hash=msg.prefix_hash, append_tokens=tuple(msg.append_tokens))


def commit_to_pb(commit: Commit) -> common_pb2.CacheCommit:
    return common_pb2.CacheCommit(cache_len=commit.cache_len, prefix_hash=commit.prefix_hash,
                                  append_tokens=list(commit.append_tokens))


def dist_from_pb(msg: worker_pb2.SparseDistribution) -> SparseDist:
    return SparseDist(token_ids=torch.tensor(list(msg.token_ids), dtype=torch.int64),
                      probs=torch.tensor(list(msg.probs), dtype=torch.float32))


def dist_to_pb(dist: SparseDist) -> worker_pb2.SparseDistribution:
    return worker_pb2.SparseDistribution(token_ids=dist.token_ids.tolist(), probs=dist.probs.tolist())


def timing_to_pb(stats: CallStats) -> common_pb2.WorkerTiming:
    return common_pb2.WorkerTiming(compute_ms=stats.compute_ms, fed_tokens=stats.fed_tokens,
                                   prefilled_tokens=stats.prefilled_tokens, catchup_ms=stats.catchup_ms,
                                   draft_steps=stats.draft_steps)
