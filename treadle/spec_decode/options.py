"""``speculative_config``: its keys and defaults, the parse into a SpeculativeConfig, and what a
method needs from the target checkpoint (a draft model's config and vocabulary check, a draft
head's directory and the bytes its KV slots keep). The engine's resolver composes these."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from treadle.config import SPEC_METHODS, ModelConfig, SpeculativeConfig, TreadleError, json_option
from treadle.loaders import ModelSource, open_model_source
from treadle.spec_decode.head_format import HEAD_METHODS, eagle_layer_config, read_head_config

# the keys of ``speculative_config`` and their defaults (the resolver settles the rest)
SPECULATIVE_DEFAULTS: dict[str, Any] = {
    "method": None, "model": None, "num_speculative_tokens": 4, "prompt_lookup_min": 2,
    "prompt_lookup_max": 4, "fallback": True,
}


def resolve_speculative(raw: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """``speculative_config`` (a dict, or its JSON text from the CLI) -> SpeculativeConfig;
    None or an empty value -> None. Unknown keys and bad values are one-line TreadleErrors."""
    parsed = json_option(raw, "speculative_config", SPECULATIVE_DEFAULTS, '{"method": "ngram"}')
    if parsed is None:
        return None
    spec = {**SPECULATIVE_DEFAULTS, **parsed}
    method = spec["method"] or ("draft_model" if spec["model"] else None)
    if method not in SPEC_METHODS:
        raise TreadleError(f"speculative_config method {method!r} is not one of {', '.join(SPEC_METHODS)}")
    ints = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
    for key in ints:
        if not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 1:
            raise TreadleError(f"speculative_config {key} must be an integer of at least 1")
    if spec["prompt_lookup_min"] > spec["prompt_lookup_max"]:
        raise TreadleError("speculative_config prompt_lookup_min must not exceed prompt_lookup_max")
    if not isinstance(spec["fallback"], bool):
        raise TreadleError("speculative_config fallback must be true or false")
    model, draft_layers = _draft_model_name(method, spec["model"])
    return SpeculativeConfig(method=method, model=model, draft_layers=draft_layers, fallback=spec["fallback"],
                             **{k: spec[k] for k in ints})


def _draft_model_name(method: str, model: object) -> tuple[str | None, int | None]:
    """(path or name, None) or, for ``"self:N"``, (None, N): the target's first N layers; an
    eagle / medusa head's directory (None: the target's own, see ``with_draft_head``)."""
    if method in HEAD_METHODS:
        if model is not None and (not isinstance(model, str) or not model):
            raise TreadleError(f'speculative method {method} needs "model": a draft-head directory')
        return model, None
    if method != "draft_model":
        return None, None
    if not isinstance(model, str) or not model:
        raise TreadleError('speculative method draft_model needs "model": a path, a name, or "self:N" '
                           "(the target's first N layers)")
    if not model.startswith("self:"):
        return model, None
    n = model.removeprefix("self:")
    if not n.isdigit() or int(n) < 1:
        raise TreadleError(f'speculative_config model {model!r}: "self:N" needs a layer count N of at least 1')
    return None, int(n)


def draft_model_config(spec: SpeculativeConfig | None, target: ModelSource) -> ModelConfig | None:
    """The config of a draft model with its own KV cache (None: no draft, or a layer-skip one
    sharing the target's KV); checks the draft's vocabulary against the target's."""
    if spec is None or spec.method != "draft_model":
        return None
    if spec.draft_layers is not None:
        if spec.draft_layers >= target.config.num_layers:
            raise TreadleError(f"speculative_config model 'self:{spec.draft_layers}': the draft must use fewer "
                               f"layers than the target's {target.config.num_layers}")
        return None
    assert spec.model is not None
    draft = open_model_source(spec.model)
    if draft.config.vocab_size != target.config.vocab_size:
        raise TreadleError(f"draft model {spec.model}: vocabulary of {draft.config.vocab_size} tokens, the "
                           f"target's has {target.config.vocab_size}; a draft needs the target's vocabulary")
    probe = "Once upon a time, 42 cats said: hello!"
    if draft.tokenizer is not None and target.tokenizer is not None and \
            draft.tokenizer.encode(probe) != target.tokenizer.encode(probe):
        raise TreadleError(f"draft model {spec.model}: its tokenizer differs from the target's; "
                           "a draft needs the target's vocabulary")
    return draft.config


def with_draft_head(spec: SpeculativeConfig | None, target: ModelSource) -> SpeculativeConfig | None:
    """eagle / medusa: the head's directory (default: the target directory's
    ``draft-heads/<method>``, e.g. the heads shipped with stories260k), checked against the
    target (a one-line TreadleError for a missing, malformed or mismatched head)."""
    if spec is None or spec.method not in HEAD_METHODS:
        return spec
    model = spec.model
    if model is None:
        default = target.path / "draft-heads" / spec.method
        if not (target.path.is_dir() and default.is_dir()):
            raise TreadleError(f'speculative method {spec.method} needs "model": a draft-head directory (make one '
                               f"with `treadle train-draft-head`); {target.path} ships no {spec.method} head")
        model = str(default)
    head = read_head_config(model)
    if head.method != spec.method:
        raise TreadleError(f"draft head {model} is a {head.method} head, not {spec.method}")
    why = head.target.mismatch(target.config)
    if why is not None:
        raise TreadleError(f"draft head {model} does not fit this model: {why}")
    if head.method == "medusa" and spec.num_speculative_tokens > head.num_speculative_tokens:
        raise TreadleError(f"draft head {model} has {head.num_speculative_tokens} Medusa heads; "
                           f"num_speculative_tokens {spec.num_speculative_tokens} needs as many")
    return dataclasses.replace(spec, model=model)


def draft_head_token_bytes(spec: SpeculativeConfig | None, target: ModelSource, dtype: torch.dtype) -> int:
    """Bytes per KV slot the EAGLE proposer keeps beside its KV: the target's hidden state (its
    lazy catch-up, ``spec_decode/head_proposers.py``); 0 for every other method."""
    if spec is None or spec.method != "eagle":
        return 0
    return target.config.hidden_size * dtype.itemsize


def draft_head_kv_config(spec: SpeculativeConfig | None, target: ModelSource) -> ModelConfig | None:
    """The EAGLE layer's config (its KV shares the blocks); None for every other method."""
    if spec is None or spec.method != "eagle" or spec.model is None:
        return None
    head = read_head_config(spec.model)
    assert head.layer is not None
    return eagle_layer_config(target.config, head.layer)
