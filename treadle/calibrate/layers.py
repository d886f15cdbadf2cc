"""Running one decoder layer of a transformers model on captured inputs, and the layer's
structure as the smoothing methods see it (which op feeds which linears)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn


class LayerInput(NamedTuple):
    hidden: torch.Tensor  # [batch, seq, hidden]
    kwargs: dict[str, Any]  # what the model passed besides (position embeddings, mask, ...)


class SmoothGroup(NamedTuple):
    """Linears that read the same input, and the op whose output that input is: scaling
    input channel j of the linears by s_j and dividing the op's output channel j by s_j
    leaves the float model unchanged."""

    prev: str  # an RMSNorm (divide its weight) or a Linear (divide its output rows)
    linears: tuple[str, ...]


# o_proj/down_proj first: folding them changes v_proj/up_proj, which the later groups then see
SMOOTH_GROUPS = (
    SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",)),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",)),
    SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    SmoothGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)


class _Caught(Exception):
    pass


@torch.no_grad()
def first_layer_inputs(model: nn.Module, batch: torch.Tensor, chunk: int = 16) -> list[LayerInput]:
    """What decoder layer 0 receives for each chunk of ``batch`` [samples, seq]: the model's
    forward is run up to that layer and stopped there."""
    layer0 = decoder_layers(model)[0]
    caught: list[LayerInput] = []

    def catch(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        caught.append(LayerInput(hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        raise _Caught

    handle = layer0.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for ids in batch.split(chunk):
            try:
                model(input_ids=ids, use_cache=False)
            except _Caught:
                pass
    finally:
        handle.remove()
    return caught


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)
    return layers


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: list[LayerInput]) -> list[LayerInput]:
    """The layer's outputs, ready to feed the next layer."""
    out = []
    for x in inputs:
        y = layer(x.hidden, **x.kwargs)
        out.append(LayerInput(y[0] if isinstance(y, tuple) else y, x.kwargs))
    return out


def linear(layer: nn.Module, name: str) -> nn.Linear:
    module = layer.get_submodule(name)
    assert isinstance(module, nn.Linear), name
    return module


def linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


@contextmanager
def linear_inputs(layer: nn.Module, names: list[str],
                  sink: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """While open, every forward of the named linears hands ``sink(name, x)`` its input
    flattened to [tokens, in_features]."""
    mods = linears(layer)
    handles = [
        mods[n].register_forward_pre_hook(lambda _m, args, n=n: sink(n, args[0].reshape(-1, args[0].shape[-1])))
        for n in names
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
