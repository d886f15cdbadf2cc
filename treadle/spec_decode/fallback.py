"""The fallback controller (torch-free, a collaborator of the scheduler): which running
requests get their drafts verified this step.

Acceptance alone is the wrong gate: at a high batch, acceptance stays high while a verify
step (1 + K rows per request) costs more than the tokens it wins. So the controller compares
measured throughput, per batch size bucket (powers of two):

    bucket B:  spec steps  -> EMA of emitted tokens / second
               plain steps -> EMA of emitted tokens / second
    decide:    both measured: the faster mode; the other runs once more after
               ``probe_every`` decode steps in that bucket, then after twice as many each
               time the decision holds (back to ``probe_every`` when it flips)
               spec unmeasured: predicted from a step-cost model fitted over every timed
               step, t = a + b * rows (least squares, decayed), and the mean drafts and
               accepted drafts per verify so far; speculation is tried (a probe) only
               when that model predicts it pays or cannot predict yet

and per request: a request whose accepted drafts per verify (EMA) is below what a verify
costs over a plain decode at its bucket (``cost ratio - 1``) stops speculating for
``probe_every`` steps, then probes again. Only decode-only steps are timed (a prompt chunk
would dominate the time). ``fallback=False`` always speculates (tests, benchmarks).
"""
from __future__ import annotations

from dataclasses import dataclass

from treadle.spec_decode.metrics import SpecDecodeStats

EMA = 0.2  # weight of a new measurement
DEFAULT_COST_RATIO = 1.1  # verify / plain step time before both are measured


def bucket_of(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


class _RowCost:
    """Step time as a + b * rows, fitted by least squares over decayed sums."""

    DECAY = 0.98

    def __init__(self) -> None:
        self.n = self.x = self.xx = self.y = self.xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self.n, self.x, self.xx = d * self.n + 1, d * self.x + rows, d * self.xx + rows * rows
        self.y, self.xy = d * self.y + seconds, d * self.xy + rows * seconds

    def predict(self, rows: float) -> float | None:
        """Seconds for a step of ``rows`` tokens; None until steps of different sizes were seen."""
        det = self.n * self.xx - self.x * self.x
        if self.n < 2 or det <= 1e-9 * max(1.0, self.n * self.xx):
            return None
        b = max(0.0, (self.n * self.xy - self.x * self.y) / det)
        a = max(0.0, (self.y - b * self.x) / self.n)
        return a + b * rows


@dataclass
class _Bucket:
    spec_rate: float | None = None  # tokens / s on speculating steps
    plain_rate: float | None = None
    spec_time: float | None = None  # seconds per step
    plain_time: float | None = None
    steps: int = 0
    next_probe: int = 0  # step count (in this bucket) of the next probe of the other mode
    interval: int = 0  # steps until the probe after it
    last_faster: bool | None = None

    def cost_ratio(self) -> float:
        if self.spec_time is None or self.plain_time is None:
            return DEFAULT_COST_RATIO
        return self.spec_time / self.plain_time


@dataclass
class _RequestState:
    accepted: float = 1.0  # EMA of accepted drafts per verify (optimistic start)
    off_until: int = -1  # step number until which the request does not speculate


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class FallbackController:
    def __init__(self, enabled: bool, probe_every: int = 32, stats: SpecDecodeStats | None = None) -> None:
        self.enabled, self.probe_every = enabled, probe_every
        self.stats = stats if stats is not None else SpecDecodeStats()
        self._buckets: dict[int, _Bucket] = {}
        self._requests: dict[str, _RequestState] = {}
        self._cost = _RowCost()
        self._step = 0

    def speculate_batch(self, batch_size: int) -> bool:
        """Whether this step (``batch_size`` running requests) verifies drafts at all."""
        self._step += 1
        if not self.enabled:
            return True
        b = self._buckets.setdefault(bucket_of(batch_size), _Bucket())
        b.steps += 1
        if b.spec_rate is None:
            if self._predicted_to_pay(batch_size) is False:
                self.stats.num_batch_fallbacks += 1
                return False
            return True
        if b.plain_rate is None:
            self.stats.num_probes += 1
            return False
        faster = b.spec_rate >= b.plain_rate
        if faster != b.last_faster:  # a new decision: re-check it soon
            b.last_faster, b.interval, b.next_probe = faster, self.probe_every, b.steps + self.probe_every
        if b.steps >= b.next_probe:
            self.stats.num_probes += 1
            b.next_probe, b.interval = b.steps + 2 * b.interval, 2 * b.interval
            return not faster
        if not faster:
            self.stats.num_batch_fallbacks += 1
        return faster

    def _predicted_to_pay(self, batch_size: int) -> bool | None:
        """From the step-cost model and the drafts / acceptance so far; None: cannot tell."""
        st = self.stats
        if st.num_drafts == 0:
            return None
        drafts, accepted = st.num_draft_tokens / st.num_drafts, st.num_accepted_tokens / st.num_drafts
        plain, spec = self._cost.predict(batch_size), self._cost.predict(batch_size * (1 + drafts))
        if plain is None or spec is None or plain <= 0 or spec <= 0:
            return None
        return batch_size * (1 + accepted) / spec >= batch_size / plain

    def speculate_request(self, request_id: str) -> bool:
        if not self.enabled:
            return True
        st = self._requests.get(request_id)
        if st is None or st.off_until < self._step:
            return True
        if st.off_until == self._step:
            self.stats.num_probes += 1
            st.accepted = 1.0  # probe with a fresh estimate
            return True
        return False

    def observe_verify(self, request_id: str, batch_size: int, num_accepted: int) -> None:
        """A request verified drafts and ``num_accepted`` of them were accepted."""
        if not self.enabled:
            return
        st = self._requests.setdefault(request_id, _RequestState())
        st.accepted = _ema(st.accepted, num_accepted)
        ratio = self._buckets.get(bucket_of(batch_size), _Bucket()).cost_ratio()
        if st.accepted < ratio - 1.0:
            st.off_until = self._step + self.probe_every
            self.stats.num_request_fallbacks += 1

    def observe_step(self, batch_size: int, speculated: bool, num_emitted: int, seconds: float,
                     num_rows: int | None = None) -> None:
        """A decode-only step's wall time, tokens emitted and rows run (decodes + drafts)."""
        if not self.enabled or seconds <= 0:
            return
        self._cost.observe(batch_size if num_rows is None else num_rows, seconds)
        b = self._buckets.setdefault(bucket_of(batch_size), _Bucket())
        if speculated:
            b.spec_rate, b.spec_time = _ema(b.spec_rate, num_emitted / seconds), _ema(b.spec_time, seconds)
        else:
            b.plain_rate, b.plain_time = _ema(b.plain_rate, num_emitted / seconds), _ema(b.plain_time, seconds)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
