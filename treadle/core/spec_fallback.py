"""The fallback controller (torch-free, a collaborator of the scheduler): which running
requests get their drafts verified this step.

Acceptance alone is the wrong gate: at a high batch, acceptance stays high while a verify
step (1 + K rows per request) costs more than the tokens it wins. So the controller compares
measured throughput, per batch size bucket (powers of two):

    bucket B:  spec steps  -> EMA of emitted tokens / second
               plain steps -> EMA of emitted tokens / second
    decide:    both measured: the faster mode (speculation only where the step-cost model
               below does not predict the opposite); the other runs once more after
               ``probe_every`` decode steps in that bucket, then after twice as many each
               time the decision holds (back to ``probe_every`` when it flips)
               spec unmeasured: predicted from a step-cost model fitted over every timed
               step, t = a + b * rows (least squares, decayed), and the mean drafts and
               accepted drafts per verify so far; speculation is tried (a probe) only
               when that model predicts it pays or cannot predict yet

and per request: a request whose accepted drafts per verify (EMA) is below what a verify
costs over a plain decode at its bucket (``cost ratio - 1``, the ratio at least
``MIN_COST_RATIO``) stops speculating for
``probe_every`` steps, then probes again. Every step is timed for the step-cost model, steps
carrying prompt chunks too (their prompt rows are a separate term, so the model is fitted during
the prompt phase, before the first decode-only step); only decode-only steps give a bucket its
measured rates. A step that carries a prompt chunk verifies no drafts (``speculate_batch``).
``fallback=False`` always speculates (tests, benchmarks).
"""
from __future__ import annotations

from dataclasses import dataclass

from treadle.core.spec_metrics import SpecDecodeStats

EMA = 0.2  # weight of a new measurement
DEFAULT_COST_RATIO = 1.1  # verify / plain step time before both are measured
# a verify step runs more rows than the plain step plus the proposer: a measured ratio below
# this is timing noise on a busy machine, and must not keep a request that accepts nothing on
MIN_COST_RATIO = 1.1


def bucket_of(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gauss-Jordan, partial pivoting); an unknown without a usable pivot is 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(1e-300, max(abs(v) for row in a for v in row))
    pivots: dict[int, int] = {}  # column -> row
    r = 0
    for c in range(n):
        p = max(range(r, n), key=lambda k: abs(m[k][c]), default=None)
        if p is None or abs(m[p][c]) <= 1e-12 * scale:
            continue
        m[r], m[p] = m[p], m[r]
        for k in range(n):
            if k != r and m[k][c]:
                f = m[k][c] / m[r][c]
                m[k] = [x - f * y for x, y in zip(m[k], m[r])]
        pivots[c], r = r, r + 1
    return [m[pivots[c]][n] / m[pivots[c]][c] if c in pivots else 0.0 for c in range(n)]


class _RowCost:
    """Step time as a + b * decode rows + c * draft rows + e * prompt rows + f [prompt rows > 0],
    fitted by least squares over decayed sums. Every step is timed, mixed prompt + decode steps
    too (their prompt rows are terms of their own, so they teach b instead of being dropped); a
    verify row may cost more than a plain decode row (c: its extra), which only steps with
    and without drafts can tell apart; until then a small ridge keeps c at 0. A step with a
    prompt chunk has its own fixed cost f: without it, a few slow prefill steps of similar
    lengths on a busy machine (a 1.4 s "intercept" from two noisy points) took over a, and the
    model predicted a 1-row decode step at 0.6 s and switched batch-1 speculation off. While
    every step so far carried a prompt chunk, a takes f's share (the first pivot), so a decode
    step is still predicted from those steps."""

    DECAY = 0.98
    RIDGE = 1e-3  # on c, relative to the decode rows' scale

    def __init__(self) -> None:
        self._xx = [[0.0] * 5 for _ in range(5)]  # decayed sum of x x^T, x = [1, decode, draft, prompt rows, prompt?]
        self._xy = [0.0] * 5
        self._coef: list[float] | None = None  # fitted (a, b, c), None: refit at the next predict

    def observe(self, rows: int, seconds: float, prompt_rows: int = 0, draft_rows: int = 0) -> None:
        """``rows``: decode rows, drafts included (``draft_rows`` of them)."""
        x, d = (1.0, float(rows), float(draft_rows), float(prompt_rows), float(prompt_rows > 0)), self.DECAY
        self._xx = [[d * self._xx[i][j] + x[i] * x[j] for j in range(5)] for i in range(5)]
        self._xy = [d * self._xy[i] + x[i] * seconds for i in range(5)]
        self._coef = None

    def predict(self, rows: float, draft_rows: float = 0.0) -> float | None:
        """Seconds for a decode-only step of ``rows`` tokens, ``draft_rows`` of them drafts;
        None until steps with different numbers of decode rows were seen."""
        n, x, xx = self._xx[0][0], self._xx[0][1], self._xx[1][1]
        if n < 2 or n * xx - x * x <= 1e-9 * max(1.0, n * xx):
            return None
        if self._coef is None:  # once per observed step: predict runs per request and step
            a = [row[:] for row in self._xx]
            a[2][2] += self.RIDGE * max(1.0, xx / n)
            self._coef = [max(0.0, v) for v in _solve(a, self._xy)[:3]]
        base, b, c = self._coef
        return base + b * rows + c * draft_rows


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
        self._with_prompt = False  # this step carries a prompt chunk (so, likely, the next one)

    def speculate_batch(self, batch_size: int, has_drafts: bool = True, with_prompt: bool = False) -> bool:
        """Whether this step (``batch_size`` running requests) verifies drafts at all. Called
        every step (``has_drafts`` False: no request drafted, nothing is counted) so that a probe
        comes due while the runner drafts for nobody (``will_speculate``). A step that will
        carry a prompt chunk (``with_prompt``) verifies none: its hundreds of prompt rows make
        it compute-bound, so a draft row costs a full row and a rejected one is pure loss, and
        draft rows would shrink the chunks (later first tokens). Measured at 32 requests: 252
        draft rows in the first 5 (prompt) steps, the run 0.97x of no speculation."""
        self._step += 1
        self._with_prompt = with_prompt
        if not self.enabled:
            return True
        if with_prompt:
            self.stats.num_batch_fallbacks += has_drafts
            return False
        b = self._buckets.setdefault(bucket_of(batch_size), _Bucket())
        b.steps += 1
        fallback, probe, speculate = self._decide(b, batch_size)
        if has_drafts:
            self.stats.num_batch_fallbacks += fallback
            self.stats.num_probes += probe
        return speculate

    def _decide(self, b: _Bucket, batch_size: int) -> tuple[bool, bool, bool]:
        """(a fallback, a probe, speculate) for this step of bucket ``b``; schedules the next probe."""
        if b.spec_rate is None:
            pays = self._predicted_to_pay(batch_size) is not False
            return not pays, False, pays
        if b.plain_rate is None:
            return False, True, False
        faster = self._faster(b, batch_size)
        if faster != b.last_faster:  # a new decision: re-check it soon
            b.last_faster, b.interval, b.next_probe = faster, self.probe_every, b.steps + self.probe_every
        if b.steps >= b.next_probe:
            b.next_probe, b.interval = b.steps + 2 * b.interval, 2 * b.interval
            return False, True, not faster
        return not faster, False, faster

    def will_speculate(self, request_id: str, batch_size: int) -> bool:
        """Whether the next step (about ``batch_size`` running requests) would verify this
        request's drafts, read without changing anything: the runner drafts only for those (a
        draft model's K forwards are wasted on drafts that would be dropped)."""
        if not self.enabled:
            return True
        st = self._requests.get(request_id)
        if self._with_prompt or (st is not None and st.off_until > self._step + 1):
            return False
        b = self._buckets.get(bucket_of(batch_size))
        if b is None or b.spec_rate is None:
            return self._predicted_to_pay(batch_size) is not False
        if b.plain_rate is None:
            return False
        faster = self._faster(b, batch_size)
        next_probe = b.next_probe if faster == b.last_faster else b.steps + 1 + self.probe_every
        return (not faster) if b.steps + 1 >= next_probe else faster

    def _faster(self, b: _Bucket, batch_size: int) -> bool:
        """Speculation is the faster mode of a measured bucket: its measured rate is higher and
        the step-cost model (fitted over every step, so far less noisy than two EMAs on a busy
        machine) does not predict the opposite. At a large batch a verify row costs as much as
        a decode row, so drafts pay only through the per-step cost they save: a few noisy
        steps must not keep hundreds of verifies running (measured: 0.88x at 32 requests)."""
        assert b.spec_rate is not None and b.plain_rate is not None
        return b.spec_rate >= b.plain_rate and self._predicted_to_pay(batch_size) is not False

    def _predicted_to_pay(self, batch_size: int) -> bool | None:
        """From the step-cost model and the drafts / acceptance so far; None: cannot tell."""
        st = self.stats
        if st.num_drafts == 0:
            return None
        drafts, accepted = st.num_draft_tokens / st.num_drafts, st.num_accepted_tokens / st.num_drafts
        plain, spec = self._cost.predict(batch_size), self._cost.predict(batch_size * (1 + drafts), batch_size * drafts)
        if plain is None or spec is None or plain <= 0 or spec <= 0:
            return None
        return batch_size * (1 + accepted) / spec >= batch_size / plain

    def _cost_ratio(self, batch_size: int) -> float:
        """Verify step / plain step time at this batch size: measured, else predicted."""
        b = self._buckets.get(bucket_of(batch_size))
        if b is not None and b.spec_time is not None and b.plain_time is not None:
            return b.cost_ratio()
        st = self.stats
        drafts = st.num_draft_tokens / st.num_drafts if st.num_drafts else 0.0
        plain, spec = self._cost.predict(batch_size), self._cost.predict(batch_size * (1 + drafts), batch_size * drafts)
        if plain is None or spec is None or plain <= 0:
            return DEFAULT_COST_RATIO
        return spec / plain

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
        ratio = max(self._cost_ratio(batch_size), MIN_COST_RATIO)
        if st.accepted < ratio - 1.0:
            st.off_until = self._step + self.probe_every
            self.stats.num_request_fallbacks += 1

    def observe_step(self, batch_size: int, speculated: bool, num_emitted: int, seconds: float,
                     num_rows: int | None = None, num_prompt_rows: int = 0, num_draft_rows: int = 0) -> None:
        """A step's wall time, tokens emitted, decode rows run (decodes + drafts, ``num_draft_rows``
        of them drafts) and prompt rows (chunks). Every step feeds the step-cost model; only decode-only steps feed the
        batch size's measured rates (a chunk's time is not the decodes')."""
        if not self.enabled or seconds <= 0:
            return
        self._cost.observe(batch_size if num_rows is None else num_rows, seconds, num_prompt_rows, num_draft_rows)
        if num_prompt_rows:
            return
        b = self._buckets.setdefault(bucket_of(batch_size), _Bucket())
        if speculated:
            b.spec_rate, b.spec_time = _ema(b.spec_rate, num_emitted / seconds), _ema(b.spec_time, seconds)
        else:
            b.plain_rate, b.plain_time = _ema(b.plain_rate, num_emitted / seconds), _ema(b.plain_time, seconds)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
