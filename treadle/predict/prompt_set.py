"""The length-varied prompt set: instruction templates that imply their answer's length
(one word ... several hundred tokens) x topics, split by topic into train and held-out.

``build()`` is deterministic; ``treadle/assets/length_prompts.jsonl`` is its output,
committed (one JSON object a line: ``text``, ``kind`` short|medium|long, ``split``
train|heldout, ``template``, ``topic``). Held-out topics never occur in training prompts.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

ASSET = Path(__file__).resolve().parents[1] / "assets" / "length_prompts.jsonl"

TEMPLATES: dict[str, tuple[str, ...]] = {
    "short": (
        "Answer in one word: what colour do you think of for {t}?",
        "Reply with only yes or no: is {t} interesting?",
        "In one word, how would you describe {t}?",
        "Give a single word that rhymes with or relates to {t}. Only the word.",
    ),
    "medium": (
        "Explain {t} in two sentences.",
        "List five facts about {t}.",
        "Write a short paragraph about {t}.",
        "Give three tips for someone learning about {t}.",
    ),
    "long": (
        "Write a long story about {t}, with several characters and many events.",
        "List twenty different things related to {t}, one per line, each with a sentence of explanation.",
        "Write a detailed essay about {t} with an introduction, five sections and a conclusion.",
        "Describe {t} in great detail, in at least six paragraphs.",
    ),
}

TOPICS = (
    "cats", "the ocean", "volcanoes", "bicycles", "coffee", "the moon", "rainforests", "chess",
    "bread baking", "honey bees", "trains", "the piano", "snow", "gardening", "dinosaurs", "clocks",
    "lighthouses", "mountains", "football", "paper", "dragons", "the desert", "robots", "islands",
    # held out (never in training prompts)
    "kites", "penguins", "castles", "thunderstorms", "libraries", "rivers", "pirates", "tea",
    "owls", "bridges", "circus", "the forest",
)
NUM_HELDOUT_TOPICS = 12


@dataclass(frozen=True)
class LengthPrompt:
    text: str
    kind: str  # short | medium | long: the length the instruction implies
    split: str  # train | heldout
    template: int
    topic: str


def build() -> list[LengthPrompt]:
    heldout = set(TOPICS[-NUM_HELDOUT_TOPICS:])
    out = []
    for topic in TOPICS:
        for kind, templates in TEMPLATES.items():
            for i, template in enumerate(templates):
                out.append(LengthPrompt(template.format(t=topic), kind, "heldout" if topic in heldout else "train",
                                        i, topic))
    return out


def load(path: Path = ASSET, split: str | None = None) -> list[LengthPrompt]:
    """The committed set (or another file in its format), optionally one split."""
    rows = [LengthPrompt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if split is None or r.split == split]


def write(path: Path = ASSET) -> None:
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in build()))
