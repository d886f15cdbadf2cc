"""The output-length predictor (treadle/predict): features, fit, format, the shipped ones."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from treadle.config import TreadleError
from treadle.predict import prompt_set
from treadle.predict.model import (
    CONFIG_NAME,
    LengthPredictor,
    PredictorConfig,
    bucket_ids,
    resolve_predictor,
    shipped_for,
)
from treadle.predict.training import FitSettings, fit, kendall_tau


def test_kendall_tau_matches_hand_counts():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # pairs: (1,2)+ (1,3)+ (1,4)+ (2,3)- (2,4)+ (3,4)+ -> (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)


def test_buckets_are_deterministic_and_order_aware():
    a = bucket_ids([5, 6, 7], 1 << 14, (1, 2, 3))
    assert len(a) == 6 and np.array_equal(np.sort(a), np.sort(bucket_ids([5, 6, 7], 1 << 14, (1, 2, 3))))
    b = bucket_ids([7, 6, 5], 1 << 14, (1, 2, 3))
    assert set(a[:0]) == set() and set(a) != set(b)  # same unigrams, other bigrams
    assert len(bucket_ids([], 64, (1, 2))) == 0


def synthetic(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Token 11 means 'one word', 12 'a paragraph', 13 'a long story'; the rest is topic noise."""
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(n):
        kind = rng.randrange(3)
        noise = [rng.randrange(100, 5000) for _ in range(rng.randrange(3, 12))]
        prompts.append([1, 2] + noise[: len(noise) // 2] + [11 + kind] + noise[len(noise) // 2:])
        lengths.append([2, 60, 400][kind] + rng.randrange(0, [3, 40, 100][kind]))
    return prompts, lengths


def test_fit_ranks_unseen_prompts_and_roundtrips(tmp_path):
    prompts, lengths = synthetic(150, 0)
    pred = fit(prompts, lengths, PredictorConfig(num_buckets=4096, model="synthetic"), FitSettings(steps=200))
    test_prompts, test_lengths = synthetic(60, 1)
    tau = kendall_tau(pred.predict(test_prompts), test_lengths)
    assert tau > 0.5
    short, long_ = pred.predict([[1, 2, 11, 777], [1, 2, 13, 777]])
    assert short < 20 < 150 < long_  # on the log-length scale, not only in order
    pred.save(tmp_path / "p")
    again = LengthPredictor.load(tmp_path / "p")
    assert again.predict(test_prompts) == pred.predict(test_prompts)
    assert json.loads((tmp_path / "p" / CONFIG_NAME).read_text())["model"] == "synthetic"


def test_bad_predictor_dirs_are_one_clear_error(tmp_path):
    with pytest.raises(TreadleError, match="cannot read the length predictor"):
        LengthPredictor.load(tmp_path)
    pred = LengthPredictor(PredictorConfig(num_buckets=16), np.zeros(16, np.float32), np.zeros(2, np.float32))
    pred.save(tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / CONFIG_NAME).read_text())
    (tmp_path / "p" / CONFIG_NAME).write_text(json.dumps({**cfg, "format": 9}))
    with pytest.raises(TreadleError, match="format 9"):
        LengthPredictor.load(tmp_path / "p")
    with pytest.raises(TreadleError, match="expected"):
        LengthPredictor(PredictorConfig(num_buckets=16), np.zeros(8, np.float32), np.zeros(2, np.float32))
    assert resolve_predictor("none", "stories260k") is None
    assert resolve_predictor("auto", "no-such-model") is None


def test_prompt_set_is_the_committed_one_and_holds_out_topics():
    rows = prompt_set.load()
    assert rows == prompt_set.build()
    train_topics = {r.topic for r in rows if r.split == "train"}
    held_topics = {r.topic for r in rows if r.split == "heldout"}
    assert held_topics and not train_topics & held_topics
    assert {r.kind for r in rows} == {"short", "medium", "long"}


@pytest.mark.parametrize("model", ["stories260k", "smollm2-135m-instruct"])
def test_shipped_predictor_and_its_heldout_tau(model):
    """The shipped predictor loads, and its recorded held-out lengths (the model's own greedy
    answers) give the tau its config states, recomputed here."""
    path = shipped_for(model)
    assert path is not None
    pred = LengthPredictor.load(path)
    rows = [json.loads(line) for line in (path / "lengths.jsonl").read_text().splitlines()]
    held = [r for r in rows if r["split"] == "heldout"]
    tau = kendall_tau([r["predicted"] for r in held], [r["length"] for r in held])
    assert tau == pytest.approx(pred.config.training["kendall_tau_heldout"], abs=1e-3)
