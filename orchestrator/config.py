"""The adaptive-k configuration: one dataclass, one validation, one merge order.

Server defaults come from the TOML `[speculation]` table (what the k8s ConfigMap carries), then CLI
flags; a request may override some fields. All three go through `SpeculationConfig`, and the table in
docs/adaptive-k.md is generated from the field docs here (a test keeps them equal).
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

from orchestrator.guard import GuardSettings
from orchestrator.kpolicy import BanditPolicy, CostModelPolicy, FixedPolicy, HeuristicPolicy, KPolicy
from specdec.contract import MAX_BRANCH_SLOTS, MAX_K
from specdec.errors import InvalidRequest

PolicyName = Literal["fixed", "heuristic", "cost", "bandit"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
OverlapMode = Literal["auto", "on", "off"]
OVERLAP_MODES: tuple[str, ...] = get_args(OverlapMode)


class SpeculationConfigError(InvalidRequest, ValueError):
    """A bad value: INVALID_ARGUMENT in a request, a ValueError in a config file or a flag."""


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class SpeculationOverride:
    """What one request may change (None: keep the server's value)."""
    policy: str | None = None
    min_k: int | None = None
    max_k: int | None = None
    fixed_k: int | None = None
    min_draft_prob: float | None = None
    pipeline: bool | None = None
    pipeline_branches: int | None = None
    overlap_prefill: bool | None = None


def _finite(value: int | float) -> bool:
    """A finite float; an integer too large for a float (TOML allows any length) is not."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SpeculationConfig:
    policy: PolicyName = field(default="cost", metadata=_doc(
        "How k is chosen each round: `fixed`, `heuristic` (HF's +2/-1 schedule), `cost` (maximise "
        "expected tokens per second from measured costs; k = 0 when speculation loses) or `bandit` "
        "(UCB over k seeded by the cost model). Per request: `speculation.policy`."))
    min_k: int = field(default=0, metadata=_doc(
        "Smallest k a policy may pick. 0 allows target-only rounds. Per request: `speculation.min_k`."))
    max_k: int = field(default=8, metadata=_doc(
        f"Largest k a policy may pick (at most {MAX_K}). Per request: `speculation.max_k`."))
    fixed_k: int = field(default=4, metadata=_doc(
        "k of the `fixed` policy. A request's `speculation.fixed_k` runs the fixed policy at that k, "
        "whatever the other fields say."))
    min_draft_prob: float = field(default=0.0, metadata=_doc(
        "Early stop: the draft stops before a position where its most likely token has a probability "
        "below this (0 = off). Lossless: decided before a token is drawn. Per request: "
        "`speculation.min_draft_prob`."))
    pipeline: bool = field(default=False, metadata=_doc(
        "Pipelined rounds: while the target verifies round n, the draft drafts round n+1 assuming round "
        "n is fully accepted; a hit skips the wait for the draft. Lossless; with a float32 draft the "
        "output is even the serial one token for token. Pays "
        "where draft and target run on different devices or nodes; off by default because on one "
        "shared CPU the two forwards compete for the same cores. Per request: `speculation.pipeline`."))
    pipeline_branches: int = field(default=2, metadata=_doc(
        "Pipelined rounds: besides the pre-draft that assumes full acceptance, pre-draft on up to this "
        "many branches for the likeliest rejections (the draft's runner-up token taken as the target's "
        f"correction), each in a slot of the draft's session forked from its cache (0 = off, at most "
        f"{MAX_BRANCH_SLOTS}). A branch that guessed right supplies the next round's drafts at once. "
        "Lossless. Costs draft compute during the verify and up to this many extra copies of a "
        "session's draft KV cache. Per request: `speculation.pipeline_branches`."))
    overlap_prefill: OverlapMode = field(default="auto", metadata=_doc(
        "Prefill overlap: a turn's first round runs target-only while the draft prefills the new prompt "
        "beside it and pre-drafts round 2 (its first token a guess of the target's), so the first token "
        "does not wait for the draft's prefill. For the `cost` and `bandit` policies with min_k = 0. "
        "`\"on\"`: when the target has more than 16 tokens to prefill. `\"auto\"`: where this server "
        "config has `pipeline` on (the two workers on different devices), per turn where the measured "
        "costs price it below the serial first round (docs/pipelining.md); otherwise as `\"off\"`: on "
        "one shared CPU the two prefills compete for the same cores. `true` / `false` read as `\"on\"` / "
        "`\"off\"`. Per request: `speculation.overlap_prefill` (true: on, false: off)."))
    guard: bool = field(default=True, metadata=_doc(
        "Pair guard: the worker pair runs in epochs, speculating or target-only for all its sessions at "
        "once, and keeps the mode that made more tokens per second over whole turns (a turn's first "
        "round, then steady rounds), re-measuring the other in short epochs (docs/adaptive-k.md, \"The "
        "pair guard\"). It catches what per-session costs miss: a co-located draft slowing every verify, "
        "load. For the `cost` and `bandit` policies with min_k = 0."))
    guard_spec_rounds: int = field(default=32, metadata=_doc(
        "Pair guard: fewest counted rounds of a speculating epoch. The winning mode's epochs also "
        "last 4x the time of the other mode's last epoch, doubled per decision that confirms it, and "
        "long enough that the loser's epochs cost about 3 % of throughput; up to 64x."))
    guard_off_rounds: int = field(default=8, metadata=_doc(
        "Pair guard: fewest counted rounds of a target-only epoch."))
    guard_margin: float = field(default=0.03, metadata=_doc(
        "Pair guard: the losing mode must beat the winner by this fraction to take over."))
    guard_rounds_per_session: int = field(default=4, metadata=_doc(
        "Pair guard: every epoch also counts at least this many rounds per round in flight at once on "
        "the pair (32 at 8 streams), so that a short epoch is more than one batched step (0 = off)."))
    guard_cut_loss: float = field(default=0.25, metadata=_doc(
        "Pair guard: a speculating probe (target-only leading) that trails target-only's rate by this "
        "fraction once it has counted half its rounds ends there, lost (0 = off). Target-only epochs are "
        "never cut short."))
    guard_arrival_window_ms: float = field(default=20.0, metadata=_doc(
        "Pair guard: while the pair speculates, a turn's first round waits up to this long for turns "
        "arriving with it, so that a burst is counted in the pair's load before any of its turns "
        "decides to speculate over its prompt: 2 % of the prompt's expected target forward (on the "
        "target's calibrated cost curve; no wait without one), at most this (0 = off)."))
    heuristic_initial_k: int = field(default=4, metadata=_doc("First k of the `heuristic` policy."))
    probe_every: int = field(default=16, metadata=_doc(
        "`cost` policy: after this many target-only rounds, draft one token to re-measure acceptance "
        "(0 = never)."))
    bandit_exploration: float = field(default=0.3, metadata=_doc(
        "`bandit` policy: UCB exploration bonus, relative to the best predicted rate."))
    bandit_prior_weight: float = field(default=2.0, metadata=_doc(
        "`bandit` policy: how many rounds the cost model's prediction counts as for each arm."))

    def __post_init__(self) -> None:
        # The overlap was a bool before "auto": true / false (TOML, a request) still mean on / off.
        if isinstance(self.overlap_prefill, bool):
            object.__setattr__(self, "overlap_prefill", "on" if self.overlap_prefill else "off")

    def validate(self) -> "SpeculationConfig":
        """Raise SpeculationConfigError on the first bad field; returns self so calls can chain."""
        if not (isinstance(self.overlap_prefill, str) and self.overlap_prefill in OVERLAP_MODES):
            raise SpeculationConfigError(f"overlap_prefill must be one of {', '.join(OVERLAP_MODES)} "
                                         f"(or true / false), got {self.overlap_prefill!r}")
        self._check_types()
        if self.policy not in POLICY_NAMES:
            raise SpeculationConfigError(f"unknown k policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        if not 0 <= self.fixed_k <= MAX_K:
            raise SpeculationConfigError(f"fixed_k must be in [0, {MAX_K}], got {self.fixed_k}")
        if not 0 <= self.min_k <= self.max_k <= MAX_K:
            raise SpeculationConfigError(f"need 0 <= min_k <= max_k <= {MAX_K}, got min_k={self.min_k} max_k={self.max_k}")
        if not 0.0 <= self.min_draft_prob <= 1.0:  # also rejects NaN
            raise SpeculationConfigError(f"min_draft_prob must be in [0, 1], got {self.min_draft_prob}")
        if not 1 <= self.heuristic_initial_k <= MAX_K:
            raise SpeculationConfigError(f"heuristic_initial_k must be in [1, {MAX_K}], got {self.heuristic_initial_k}")
        if not 0 <= self.pipeline_branches <= MAX_BRANCH_SLOTS:
            raise SpeculationConfigError(f"pipeline_branches must be in [0, {MAX_BRANCH_SLOTS}], "
                                         f"got {self.pipeline_branches!r}")
        try:
            self.guard_settings().validate()  # the guard's own rules, in one place
        except ValueError as exc:
            raise SpeculationConfigError(f"guard settings: {exc}") from exc
        if self.probe_every < 0:
            raise SpeculationConfigError(f"probe_every must be >= 0, got {self.probe_every}")
        if not self.bandit_exploration >= 0.0 or not self.bandit_prior_weight > 0.0:
            raise SpeculationConfigError("bandit_exploration must be >= 0 and bandit_prior_weight > 0")
        return self

    def _check_types(self) -> None:
        """Each field's type, as a TOML table can get it wrong: `max_k = 6.0` would otherwise reach a
        range() or a worker's k at the first request (INTERNAL), not the config's loading."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                ok, wanted = isinstance(value, bool), "true or false"
            elif f.type == "int":
                ok, wanted = isinstance(value, int) and not isinstance(value, bool), "an integer"
            elif f.type == "float":  # finite: TOML reads inf and nan, and no setting here means them
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
                wanted = "a finite number"
            else:
                ok, wanted = isinstance(value, str), "a string"
            if not ok:
                raise SpeculationConfigError(f"{f.name} must be {wanted}, got {value!r}")

    @property
    def picks_target_only(self) -> bool:
        """Whether the policy itself chooses between k = 0 and drafting, so that the service may run a
        round target-only in its place; a `fixed` or `heuristic` k is what the caller asked for, and so
        is a `max_k` of 0 (whose rounds say nothing about whether drafting pays)."""
        return self.policy in ("cost", "bandit") and self.min_k == 0 and self.max_k > 0

    def prefill_overlap_mode(self, devices_apart: bool) -> str:
        """How this (request's) config overlaps a turn's first round, as it applies (see
        overlap_prefill): "on", "auto" (priced per turn) or "off". `devices_apart`: the server's own
        `pipeline` setting, the deployment's word that the workers do not share cores; a request's
        `pipeline` does not make "auto" act on a co-located pair."""
        if not self.picks_target_only or (self.overlap_prefill == "auto" and not devices_apart):
            return "off"
        return self.overlap_prefill

    @property
    def guarded(self) -> bool:
        """Whether the pair guard may run this request's rounds target-only (see guard)."""
        return self.guard and self.picks_target_only

    def guard_settings(self) -> GuardSettings:
        return GuardSettings(spec_rounds=self.guard_spec_rounds, off_rounds=self.guard_off_rounds,
                             margin=self.guard_margin, rounds_per_session=self.guard_rounds_per_session,
                             cut_loss=self.guard_cut_loss, arrival_window_ms=self.guard_arrival_window_ms)

    def with_override(self, override: SpeculationOverride) -> "SpeculationConfig":
        """A request's view of the config. Precedence: request fixed_k > request fields > server."""
        if override.fixed_k is not None:
            merged = replace(self, policy="fixed", fixed_k=override.fixed_k, min_k=override.fixed_k,
                             max_k=override.fixed_k)
        else:
            changes = {name: getattr(override, name) for name in ("policy", "min_k", "max_k")
                       if getattr(override, name) is not None}
            merged = replace(self, **changes)
        if override.min_draft_prob is not None:
            merged = replace(merged, min_draft_prob=override.min_draft_prob)
        if override.pipeline is not None:
            merged = replace(merged, pipeline=override.pipeline)
        if override.pipeline_branches is not None:
            merged = replace(merged, pipeline_branches=override.pipeline_branches)
        if override.overlap_prefill is not None:
            merged = replace(merged, overlap_prefill=override.overlap_prefill)
        return merged.validate()

    def with_values(self, values: dict[str, Any], source: str) -> "SpeculationConfig":
        """Apply a table of field values (a TOML table, CLI flags); unknown keys are an error."""
        known = {f.name for f in fields(self)}
        unknown = set(values) - known
        if unknown:
            raise SpeculationConfigError(f"{source}: unknown [speculation] keys: {', '.join(sorted(unknown))}")
        try:
            return replace(self, **values).validate()
        except TypeError as exc:  # e.g. max_k = "8" in a TOML file
            raise SpeculationConfigError(f"{source}: a [speculation] value has the wrong type: {exc}") from exc
        except SpeculationConfigError as exc:  # say where the bad value came from
            raise SpeculationConfigError(f"{source}: {exc}") from exc

    @classmethod
    def from_toml(cls, path: str, base: "SpeculationConfig | None" = None) -> "SpeculationConfig":
        with open(path, "rb") as f:
            try:
                document = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise SpeculationConfigError(f"{path}: not valid TOML: {exc}") from exc
        # Everything outside [speculation] was ignored: a file without the header, or with it
        # misspelled, loaded as the defaults without a word.
        unknown = sorted(set(document) - {"speculation"})
        if unknown:
            raise SpeculationConfigError(f"{path}: unknown top-level key(s) {', '.join(unknown)}; the settings "
                                         "go in a [speculation] table")
        table = document.get("speculation", {})
        if not isinstance(table, dict):
            raise SpeculationConfigError(f"{path}: speculation must be a table ([speculation]), not {type(table).__name__}")
        return (base or cls()).with_values(table, path)

    def make_policy(self) -> KPolicy:
        if self.policy not in POLICY_NAMES:  # the rest was checked by validate(), once per request
            raise SpeculationConfigError(f"unknown k policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        if self.policy == "fixed":
            return FixedPolicy(k=self.fixed_k)
        if self.policy == "heuristic":
            return HeuristicPolicy(initial_k=self.heuristic_initial_k)
        if self.policy == "cost":
            return CostModelPolicy(probe_every=self.probe_every, pipelined=self.pipeline,
                                   branches=self.pipeline_branches)
        return BanditPolicy(exploration=self.bandit_exploration, prior_weight=self.bandit_prior_weight,
                            pipelined=self.pipeline, branches=self.pipeline_branches)

    def to_toml(self) -> str:
        lines = ["[speculation]"]
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                lines.append(f"{f.name} = {'true' if value else 'false'}")
            elif isinstance(value, str):
                lines.append(f'{f.name} = "{value}"')
            else:
                lines.append(f"{f.name} = {value!r}")
        return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The `[speculation]` reference table of docs/adaptive-k.md."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in fields(SpeculationConfig):
        rows.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['doc']} |")
    return "\n".join(rows) + "\n"
