"""Speculative-decoding counters (torch-free): what the engine stats, ``/metrics``
(``treadle_spec_decode_*``) and ``treadle bench`` report."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify steps of one request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + the correction / bonus token, per verify
    accepted_per_position: list[int] = field(default_factory=list)  # [K]: drafts accepted at position i
    num_batch_fallbacks: int = 0  # steps whose drafts were dropped: speculation does not pay at that batch size
    num_request_fallbacks: int = 0  # requests switched off for poor acceptance
    num_probes: int = 0  # steps or requests that tried speculation (or plain decode) again to re-measure

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify (1 + accepted drafts); 0 before any verify."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, float | int | list[int]]:
        return {
            "drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens, "emitted_tokens": self.num_emitted_tokens,
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
            "acceptance_rate": round(self.acceptance_rate, 3),
            "accepted_per_position": list(self.accepted_per_position),
            "batch_fallbacks": self.num_batch_fallbacks, "request_fallbacks": self.num_request_fallbacks,
            "probes": self.num_probes,
        }
