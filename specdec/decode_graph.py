"""One-token decode steps replayed from CUDA graphs: the draft's drafting steps on a GPU.

Why: on a GPU an eager transformers step is host-bound (Python and kernel launches), so a small
draft costs nearly what the target does. Measured on an H200 (docs/bench/nvidia-h200-synthetic/
2026-11-28, "decode graph"): the 24-layer draft's step 13.6-19.6 ms eager, 3.94 ms replayed over a
512-row buffer; the draft's cost ratio c falls from about 0.8, where speculation cannot win.

How: a static KV buffer (transformers' StaticCache, batch 1) mirrors the session being drafted for.
Before a step, the rows of the session's own DynamicCache that the buffer does not hold yet are
copied in (after a round's catch-up forward: a few rows; for another session: its whole prefix). The
captured step writes the token's K/V at the write position, attends over the buffer (the rows past
it masked) and returns the logits. The position (the rotary positions, the write row and the mask's
end) is the buffer's write counters (transformers' cumulative_length, a device tensor the step
advances), set before a step wherever it is not already the session's length. The new rows wait in the buffer
and are written back to the session's cache, which stays what every other path (crops, forks, batched
forwards) works on, when one of those needs it (write_back). A step attends over its whole buffer, so
there is one per length, doubling (DecodeGraphs), and a session steps on the shortest that fits it.
Without capture ("static", any device) the same steps run eagerly: what the CPU tests check against
plain steps.

Over 300 lines: the buffer's bookkeeping (which rows of which session it holds, which the session's
own cache lacks) and the startup checks that guard it stay beside the steps that depend on them.
"""
from __future__ import annotations

import logging
import statistics
import time
import weakref
from typing import Any

import torch

from specdec.contract import common_prefix_len
from specdec.scheduler import out_of_memory

log = logging.getLogger(__name__)

DECODE_GRAPH_MODES = ("auto", "on", "static", "off")
# The buffer's positions unless set: the attention of each step spans all of them, and a session
# longer than this drafts eagerly.
DEFAULT_MAX_LEN = 8192
# The startup check: each step's logits against a plain step's, as the relative L2 error. A graph
# that replays a stale position or mask is off by the logits' own size; rounding is not: bf16 sums
# the attention over the buffer in another order than the plain path, float32 agrees to ~1e-6.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-2, torch.bfloat16: 1e-1}
# The replay against the same kernels run eagerly on the same buffer: the same numbers, unless the
# capture froze what must change from step to step.
REPLAY_TOLERANCE = 1e-3


# The buffers' lengths: the smallest, then doubling up to the longest (DecodeGraphs). A step attends
# over its whole buffer, and transformers expands the KV heads to the query heads under a mask: on
# an H200 the 24-layer draft's step took 3.94 ms over a 512-row buffer and 7.53 ms over 4096 rows
# (scripts/decode_graph_costs.py, 2026-11-28), at the same 128 tokens of context.
SMALLEST_BUFFER = 256


class DecodeGraphUnsupported(RuntimeError):
    """The model's cache layers are not the plain kind the buffer mirrors."""


def resolve_mode(mode: str, role: str, device: torch.device) -> str:
    """"auto": a graph for the draft on CUDA (the target's greedy output must equal eager
    `generate`'s, and bf16 static steps round differently), else off."""
    if mode not in DECODE_GRAPH_MODES:
        raise ValueError(f"decode graph mode must be one of {', '.join(DECODE_GRAPH_MODES)}, got {mode!r}")
    if mode == "auto":
        return "on" if role == "draft" and device.type == "cuda" else "off"
    if mode == "on" and device.type != "cuda":
        raise ValueError("--decode-graph on needs a CUDA device (static runs the same steps without capture)")
    return mode


class GraphDecoder:
    """One-token steps of one session at a time over a static KV buffer; see the module docstring."""

    def __init__(self, model: torch.nn.Module, max_len: int, capture: bool) -> None:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
        self.model = model
        self.max_len = max_len
        self.device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        if not self.cache.layers or any(type(layer) is not StaticLayer for layer in self.cache.layers):
            raise DecodeGraphUnsupported("the model's static cache has sliding-window or other special layers")
        self.token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self._length = -1  # what every layer's write counter holds (-1: unknown, set before a step)
        # The session whose first len(self._held) tokens' K/V the buffer rows hold (its own rows,
        # so a step computes from exactly what the session's cache has).
        self._resident: weakref.ref[Any] | None = None
        self._held: list[int] = []
        self._graph: torch.cuda.CUDAGraph | None = None
        with torch.inference_mode():
            self._set_length(0)
            self._forward()  # allocates the buffer (the layers initialise on their first write)
            if capture:
                self._capture()
        self._length = -1
        self.nbytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers)

    def _forward(self) -> torch.Tensor:
        # transformers 5's Qwen2 takes positions from the write counters; cache_position is for
        # models that read it (always the same as the counters here).
        return self.model(input_ids=self.token, past_key_values=self.cache, use_cache=True,
                          cache_position=self.position, logits_to_keep=1).logits

    def _capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm the kernels (and any lazy set-up) outside the capture
                self._set_length(0)
                self._forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        self._set_length(0)
        with torch.cuda.graph(self._graph):
            self._logits = self._forward()
        torch.cuda.synchronize(self.device)

    def _set_length(self, length: int) -> None:
        """Point every layer's write counter at `length` (the captured step advances them by one)."""
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(length)

    # ------------------------------------------------------------------ the resident session
    # The buffer holds the K/V of the resident session's first len(self._held) tokens. Its own
    # DynamicCache may lag behind: rows the steps computed are written back to it only when
    # something else needs them (write_back: an eager forward, a fork, another session taking the
    # buffer), so a round of k drafting steps concatenates each layer's rows once, not k times.

    def resident(self) -> Any:
        return self._resident() if self._resident is not None else None

    @staticmethod
    def cached_len(session: Any) -> int:
        layers = getattr(session.cache, "layers", None)
        keys = getattr(layers[0], "keys", None) if layers else None
        return 0 if keys is None else keys.shape[-2]

    def write_back(self, session: Any, upto: int | None = None) -> None:
        """Append to the session's own cache the rows of its first `upto` tokens (all: None) that only
        the buffer holds; nothing for a session that is not resident."""
        if session is None or self.resident() is not session:
            return
        end = len(session.tokens) if upto is None else min(upto, len(session.tokens))
        start = self.cached_len(session)
        if start >= end:
            return
        if end > len(self._held) or session.tokens[start:end] != self._held[start:end]:
            raise RuntimeError(f"decode graph: the buffer does not hold rows {start}..{end} of its session")
        with torch.inference_mode():
            # Every layer's new tensors first, then assigned together: a failure (out of memory)
            # leaves every layer as it was, never some layers longer than others.
            grown = [(torch.cat([own.keys, mirror.keys[:, :, start:end]], dim=-2),
                      torch.cat([own.values, mirror.values[:, :, start:end]], dim=-2))
                     for mirror, own in zip(self.cache.layers, session.cache.layers)]
        for own, (keys, values) in zip(session.cache.layers, grown):
            own.keys, own.values = keys, values

    def discard(self, session: Any) -> None:
        if self.resident() is session:
            self.abandon()

    def forget(self) -> None:
        """Give the buffer up: the resident's rows written back first. A write-back that fails (out
        of memory) changes nothing: the resident stays, its rows still in the buffer. Abandoning it
        here trimmed a session another call may be stepping (a neighbour's step moving in), which
        then fed its next token at a shorter position."""
        self.write_back(self.resident())
        self._resident, self._held, self._length = None, [], -1

    def abandon(self) -> None:
        """After a failure: the resident keeps only what its own cache holds (its next commit re-feeds
        the rest, as after a cancelled call), and the buffer is given up without writing back."""
        session = self.resident()
        if session is not None:
            kept = self.cached_len(session)
            del session.tokens[kept:]
            prefix_keys = getattr(session, "prefix_keys", None)
            if prefix_keys is not None:
                del prefix_keys[kept:]
        self._resident, self._held, self._length = None, [], -1

    def _load(self, session: Any, token: int) -> int | None:
        """Make the buffer hold the session's rows and point the step at its next position (its
        length, returned), the session resident; None where this path cannot take the step."""
        length = len(session.tokens)
        layers = getattr(session.cache, "layers", None)
        if not 0 < length < self.max_len or not layers or len(layers) != len(self.cache.layers):
            return None
        if any(getattr(layer, "keys", None) is None for layer in layers):
            return None  # not a plain cache (or an empty one): leave it to the eager path
        cached = self.cached_len(session)
        if self.resident() is session:
            held = common_prefix_len(self._held, session.tokens)
            if cached < length and held < length:
                raise RuntimeError(f"decode graph: rows {max(cached, held)}..{length} of its session are nowhere")
        else:
            if cached != length:
                return None  # a non-resident session's own cache holds all its rows, or it is not ours
            try:
                self.forget()  # the last resident's rows written back before the buffer is overwritten
            except Exception as exc:
                if not out_of_memory(exc):
                    raise
                # Nothing changed (write_back is all or nothing): the resident keeps the buffer, and
                # this step runs eagerly rather than failing its call (failing every neighbour's
                # step for as long as memory stays short and the resident stays).
                log.warning("decode graph: writing back the resident session failed (%s); this step runs eagerly", exc)
                return None
            held = 0
        if any(layer.keys.shape[-2] != cached for layer in layers):
            return None
        if held < cached:
            for mirror, own in zip(self.cache.layers, layers):
                mirror.keys[:, :, held:cached].copy_(own.keys[:, :, held:cached])
                mirror.values[:, :, held:cached].copy_(own.values[:, :, held:cached])
        # Rows [0, length) now hold the session's tokens: from its cache, or pending from steps.
        self._resident = weakref.ref(session)
        self._held[held:] = session.tokens[held:length]
        if self._length != length:
            self._set_length(length)
        self.position.fill_(length)
        self.token.fill_(token)
        return length

    def _run(self) -> torch.Tensor:
        if self._graph is not None:
            self._graph.replay()
            return self._logits
        return self._forward()

    @torch.inference_mode()
    def step(self, session: Any, token: int) -> torch.Tensor | None:
        """The float32 logits [1, V] after feeding `token` on top of `session` (a WorkerSession: its
        `cache` and `tokens`, which the caller extends by the token); the token's row stays in the
        buffer until write_back. None where this path cannot take the step (then nothing changed:
        the caller runs it eagerly)."""
        try:
            length = self._load(session, token)
            if length is None:
                return None
            logits = self._run()
        except BaseException:
            if self.resident() is session:  # its own rows are in doubt; another resident's are not
                self.abandon()
            raise
        self._length = length + 1
        self._held.append(token)
        return logits[0, -1:].to(torch.float32, copy=True)

    @torch.inference_mode()
    def replay_error(self, session: Any, token: int) -> float | None:
        """The relative L2 error between the replayed step and the same step run eagerly on the same
        buffer (the same kernels: ~0 unless the capture froze something it should not have, such as
        a position). Leaves the session as it was; None where the step is not this path's."""
        if self._graph is None:
            return 0.0
        length = self._load(session, token)
        if length is None:
            return None
        eager = self._forward()[0, -1].float()  # writes the token's row at `length`, as the replay will
        self._set_length(length)
        replayed = self._run()[0, -1].float()
        self._length = -1  # the buffer holds the session's `length` rows and one no token names yet
        return ((replayed - eager).norm() / eager.norm().clamp_min(1e-6)).item()


def buffer_lengths(max_len: int, smallest: int = SMALLEST_BUFFER) -> list[int]:
    """smallest, 2x, 4x, ... below max_len, then max_len itself."""
    lengths = []
    length = smallest
    while length < max_len:
        lengths.append(length)
        length *= 2
    return lengths + [max_len]


class DecodeGraphs:
    """One GraphDecoder per buffer length (buffer_lengths): a session steps on the shortest buffer
    its next position fits in, so a short session's step attends over a few hundred rows, not the
    longest buffer's. Moving up to a longer buffer writes the session's rows back and copies them in
    once. The same interface as GraphDecoder, which WorkerCore uses."""

    def __init__(self, model: torch.nn.Module, max_len: int, capture: bool,
                 smallest: int = SMALLEST_BUFFER) -> None:
        self.decoders = [GraphDecoder(model, length, capture) for length in buffer_lengths(max_len, smallest)]
        self.model = model
        self.device = self.decoders[0].device
        self.max_len = max_len
        self.nbytes = sum(d.nbytes for d in self.decoders)

    def _for(self, session: Any) -> GraphDecoder | None:
        """The decoder for the session's next step, with the buffer it may hold elsewhere given up."""
        length = len(session.tokens)
        chosen = next((d for d in self.decoders if length < d.max_len), None)
        for decoder in self.decoders:
            if decoder is not chosen and decoder.resident() is session:
                decoder.forget()  # writes its rows back: the chosen buffer copies them from the cache
        return chosen

    def step(self, session: Any, token: int) -> torch.Tensor | None:
        decoder = self._for(session)
        return None if decoder is None else decoder.step(session, token)

    def replay_error(self, session: Any, token: int) -> float | None:
        decoder = self._for(session)
        return None if decoder is None else decoder.replay_error(session, token)

    def write_back(self, session: Any, upto: int | None = None) -> None:
        for decoder in self.decoders:
            decoder.write_back(session, upto)

    def discard(self, session: Any) -> None:
        """The session failed: any buffer it held is given up without writing back."""
        for decoder in self.decoders:
            decoder.discard(session)

    def forget(self) -> None:
        for decoder in self.decoders:
            decoder.forget()

    def describe(self) -> str:
        lengths = [d.max_len for d in self.decoders]
        shown = ", ".join(map(str, lengths)) if len(lengths) <= 3 else f"{lengths[0]} to {lengths[-1]}"
        return f"{len(lengths)} buffer(s) of {shown} positions ({self.nbytes / 2**20:.0f} MiB)"


@torch.inference_mode()
def _prefilled(decoder: GraphDecoder | DecodeGraphs, new_session: Any, vocab_size: int, length: int,
               gen: torch.Generator) -> Any:
    """A new session holding `length` random tokens, fed eagerly on its own cache."""
    session = new_session()
    ids = torch.randint(0, vocab_size, (1, length), generator=gen)
    decoder.model(input_ids=ids.to(decoder.device), past_key_values=session.cache, use_cache=True, logits_to_keep=1)
    session.tokens.extend(ids[0].tolist())
    return session


def check_against_eager(decoder: GraphDecoder | DecodeGraphs, new_session: Any, vocab_size: int, steps: int = 6,
                        prefixes: tuple[int, int] = (12, 7)) -> str | None:
    """None where the decoder's steps match plain one-token forwards on a copy of the same cache
    (two sessions, interleaved, so the buffer switches between them); else what differed."""
    from specdec.models import copy_cache
    model, device = decoder.model, decoder.device
    dtype = next(model.parameters()).dtype
    tolerance = CHECK_TOLERANCE.get(dtype, 1e-1)
    gen = torch.Generator().manual_seed(2)
    sessions = [_prefilled(decoder, new_session, vocab_size, prefix, gen) for prefix in prefixes]
    worst = 0.0
    with torch.inference_mode():
        for i in range(steps):
            session = sessions[i % 2]
            token = int(torch.randint(0, vocab_size, (1,), generator=gen))
            decoder.write_back(session)  # the reference runs on the session's own cache
            plain_cache = copy_cache(session.cache, len(session.tokens))
            plain = model(input_ids=torch.tensor([[token]], device=device), past_key_values=plain_cache,
                          use_cache=True, logits_to_keep=1).logits[0, -1:].float()
            replay = decoder.replay_error(session, token)
            if replay is None or not replay <= REPLAY_TOLERANCE:
                return f"step {i}: the replayed graph differs from the same step run eagerly by {replay}"
            got = decoder.step(session, token)
            if got is None:
                return f"step {i} was not taken"
            session.tokens.append(token)
            error = ((got - plain).norm() / plain.norm().clamp_min(1e-6)).item()
            worst = max(worst, error)
            if not error <= tolerance:
                return f"step {i}: logits differ by {error:.3g} of their norm (tolerance {tolerance:g})"
    decoder.forget()
    log.info("decode graph agrees with plain steps: at most %.3g of the logits' norm over %d steps", worst, steps)
    return None


def step_ms(decoder: GraphDecoder | DecodeGraphs, new_session: Any, vocab_size: int, context: int, reps: int = 8,
            sessions: int = 1) -> float:
    """Median ms of one step at about `context` cached tokens (each at the next position, as decoding),
    taking turns between `sessions` sessions (more than one: each step moves the buffer to its
    session, as the steps of a batch run one after the other do)."""
    from specdec.models import synchronize
    gen = torch.Generator().manual_seed(3)
    held = [_prefilled(decoder, new_session, vocab_size, context, gen) for _ in range(sessions)]
    with torch.inference_mode():
        times = []
        for i in range(reps + sessions):
            session = held[i % sessions]
            token = int(torch.randint(0, vocab_size, (1,), generator=gen))
            synchronize(decoder.device)
            start = time.perf_counter()
            decoder.step(session, token)
            synchronize(decoder.device)
            times.append((time.perf_counter() - start) * 1000.0)
            session.tokens.append(token)
    decoder.forget()
    return statistics.median(times[sessions:])  # each session's first step copies its whole prefix in
