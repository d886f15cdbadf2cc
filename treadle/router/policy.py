"""Which instance gets a request: pure functions over the instances' state.

- prefill instances by queued prompt tokens (the larger of what the instance last
  reported and what this router has sent it and not seen finish);
- decode and backend instances by predicted remaining work where the instance reports it
  (``/load``'s ``predicted_remaining_tokens``, plus its queued prompt tokens at the scheduler's
  ``PREFILL_TOKEN_COST``, plus requests sent since its last report at its mean cost), in units of
  ``REQUEST_COST`` tokens so the affinity slack keeps its meaning; otherwise (or with
  ``--balance count``) by running requests plus KV usage (a full cache weighs as ``KV_WEIGHT``
  running requests);
- prefix affinity: a request whose prompt starts like one sent before goes to the instance
  that computed that prompt (its prefix cache has it) unless that instance's score exceeds
  the best one by more than the role's slack.

Ties rotate, so an idle pool still spreads sequential requests.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from treadle.core.cost_policy import PREFILL_TOKEN_COST
from treadle.router.config import Role
from treadle.router.instances import Instance

KV_WEIGHT = 8.0
AFFINITY_SLACK = {Role.PREFILL: 2048.0, Role.DECODE: 4.0, Role.BACKEND: 4.0}  # in score units
PREFIX_BLOCK_CHARS = 64  # prefixes are matched in blocks of this many characters of the prompt
MAX_PREFIX_BLOCKS = 65536  # remembered (oldest forgotten first)


REQUEST_COST = 128.0  # predicted tokens a request weighs when an instance reports none yet


def cost_score(inst: Instance) -> float | None:
    """Predicted remaining work in REQUEST_COST units; None: the instance reports no predictions."""
    load = inst.load
    if load.predicted_remaining_tokens is None:
        return None
    seen = load.running + load.waiting
    per_request = load.predicted_remaining_tokens / seen if seen else REQUEST_COST
    unseen = max(0, inst.in_flight - seen)  # sent since its last report
    work = load.predicted_remaining_tokens + PREFILL_TOKEN_COST * load.waiting_prompt_tokens + unseen * per_request
    return work / REQUEST_COST


def score(inst: Instance, by_cost: bool = False) -> float:
    """Lower is less loaded."""
    load = inst.load
    if inst.role == Role.PREFILL:
        return float(max(load.waiting_prompt_tokens, inst.in_flight_prompt_tokens))
    cost = cost_score(inst) if by_cost else None
    if cost is not None:
        return cost
    return max(load.running + load.waiting, inst.in_flight) + KV_WEIGHT * load.kv_usage


@dataclass(frozen=True)
class Choice:
    instance: Instance
    reason: str  # "load" or "affinity"


def choose(candidates: list[Instance], turn: int, affinity: Instance | None = None,
           by_cost: bool = False) -> Choice | None:
    """The instance to use among the healthy ``candidates`` (None: none is healthy).
    ``turn`` rotates the tie-break; ``affinity``: the instance that holds the prompt's prefix;
    ``by_cost``: score by predicted remaining work where the instances report it."""
    healthy = [i for i in candidates if i.healthy]
    if not healthy:
        return None
    n = len(healthy)
    best = min(enumerate(healthy), key=lambda p: (score(p[1], by_cost), (p[0] - turn) % n))[1]
    if affinity is not None and affinity is not best and affinity in healthy:
        if score(affinity, by_cost) <= score(best, by_cost) + AFFINITY_SLACK[affinity.role]:
            return Choice(affinity, "affinity")
    return Choice(best, "load")


def prompt_text(body: dict[str, Any]) -> str:
    """The part of a request that decides its KV: the prompt or the messages, as text."""
    prompt = body.get("messages", body.get("prompt", ""))
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A rough prompt size (token ids counted, text at ~4 characters a token)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return len(prompt_text(body)) // 4 + 1


class PrefixIndex:
    """Chained hashes of a prompt's leading blocks -> the URL of the instance that last
    computed a prompt starting with them; least recently used blocks are forgotten."""

    def __init__(self, max_blocks: int = MAX_PREFIX_BLOCKS) -> None:
        self.owners: OrderedDict[int, str] = OrderedDict()
        self.max_blocks = max_blocks

    @staticmethod
    def _hashes(text: str) -> list[int]:
        out, h = [], 0
        for start in range(0, len(text) - PREFIX_BLOCK_CHARS + 1, PREFIX_BLOCK_CHARS):
            h = hash((h, text[start:start + PREFIX_BLOCK_CHARS]))
            out.append(h)
        return out

    def owner(self, text: str) -> str | None:
        """The instance holding the longest remembered prefix of ``text``."""
        found = None
        for h in self._hashes(text):
            url = self.owners.get(h)
            if url is None:
                break
            found = url
        return found

    def record(self, text: str, url: str) -> None:
        for h in self._hashes(text):
            self.owners[h] = url
            self.owners.move_to_end(h)
        while len(self.owners) > self.max_blocks:
            self.owners.popitem(last=False)
