"""Frozen configuration, one dataclass per concern, composed into EngineConfig."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class TreadleError(Exception):
    """A user-facing error: one clear line, never a traceback."""


class EngineDeadError(TreadleError):
    """The engine cannot go on (its step loop, an engine process or a worker died or was shut
    down): every in-flight request fails with this, and health reports unhealthy. Raised by the
    executor when a worker is lost, so layers above it need not know executors."""


class QueueFullError(TreadleError):
    """More requests are waiting than the caller allowed (backpressure)."""


class StepFailedError(TreadleError):
    """A step raised; ``request_ids`` (parent ids) were aborted with it, the engine goes on.
    ``cause``: the exception, or its repr when it happened in an engine-core process."""

    def __init__(self, request_ids: list[str], cause: BaseException | str) -> None:
        what = cause if isinstance(cause, str) else repr(cause)
        super().__init__(f"the engine step failed ({what}); {len(request_ids)} request(s) aborted")
        self.request_ids = request_ids
        self.cause = cause


class InvalidRequestError(TreadleError):
    """The engine refuses one request. ``param`` names the offending field (``prompt``,
    ``max_tokens``, ...) and ``code`` is an OpenAI error code (``context_length_exceeded``,
    ``invalid_value``), so an HTTP front can answer as OpenAI does."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# sliding_window only with use_sliding_window
_SLIDING_WHEN_ENABLED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_QKV_BIAS_BY_DEFAULT = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model's routed MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): each token goes
    to ``top_k`` of ``num_experts`` SwiGLU experts, weighted by the router's softmax (over all
    experts, then the top k kept, renormalized to sum 1 when ``norm_topk_prob``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # Mixtral: always; Qwen: the config's flag
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert, gated by sigmoid; 0: none
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here (those keep a dense MLP)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @staticmethod
    def from_hf(cfg: dict[str, Any], architecture: str) -> MoEConfig | None:
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        if not experts:
            return None
        mixtral = architecture == "MixtralForCausalLM"
        return MoEConfig(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
            norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # None: every layer has a dense MLP
    # Gemma 3: each layer's attention kind ("sliding_attention" | "full_attention"; empty: every
    # layer alike, windowed when ``sliding_window`` is set), the sliding layers' RoPE base, and
    # the softmax scale's denominator (scale = query_pre_attn_scalar ** -0.5; None: head_dim)
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes tokens to experts (else: a dense MLP)."""
        return self.moe is not None and self.moe.is_sparse(layer)

    def layer_window(self, layer: int) -> int | None:
        """Decoder layer ``layer``'s sliding window (None: it attends to every earlier key)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @staticmethod
    def from_hf(cfg: dict[str, Any], eos_override: tuple[int, ...] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or [_ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "LlamaForCausalLM")]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        local_rope = rope.get("sliding_attention") or {}  # Gemma 3 under transformers >= 5: a dict per layer kind
        rope = rope.get("full_attention", rope)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_scaling = parse_rope_scaling(rope)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window")
        if archs[0] in _SLIDING_WHEN_ENABLED and not cfg.get("use_sliding_window", False):
            sliding = None
        if float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
            raise TreadleError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        return ModelConfig(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", archs[0] in _QKV_BIAS_BY_DEFAULT))),
            rope_scaling=rope_scaling,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_override if eos_override is not None else eos_ids,
            **_gemma_fields(cfg, archs[0], local_rope),
            moe=MoEConfig.from_hf(cfg, archs[0]),
        )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the checkpoint's EOS ids (generation_config.json's
        list when there is one, e.g. stories260K stops on BOS too)."""
        return tuple(dict.fromkeys(self.eos_token_ids))


def _gemma_fields(cfg: dict[str, Any], architecture: str, local_rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's interleaved sliding / full layers (``layer_types``, or the older
    ``sliding_window_pattern``: every pattern-th layer is full), local RoPE base and softmax scale."""
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise TreadleError("logit soft-capping (final_logit_softcapping / attn_logit_softcapping) is not supported")
    if architecture != "Gemma3ForCausalLM":
        return {}
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return dict(
        layer_types=tuple(str(k) for k in kinds),
        rope_local_theta=float(local_rope.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
    )


def parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3"):
        raise TreadleError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")
    return RopeScaling(
        kind=kind,
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


# -- the resolved engine configuration ------------------------------------------------------
# Built only by ``treadle.engine.resolver.resolve_config`` from ``EngineArgs`` (the one place
# holding defaults): every field is a concrete value, no ``auto``, 0 or None placeholders.


@dataclass(frozen=True)
class LoadConfig:
    """What a worker needs to build the model."""

    model_path: str  # the resolved checkpoint: an HF directory or a .gguf file
    dtype: str  # "float32" | "bfloat16" | "float16"
    quantization: str  # "none" | "gguf" | a weight-only name ("int8", "int4-g64", ...)
    seed: int
    skip_tokenizer_init: bool  # no tokenizer anywhere: token ids in and out


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int  # per worker, what each worker allocates
    bytes_per_block: int
    enable_prefix_caching: bool
    kv_cache_dtype: str  # what the cache holds: the model's float dtype name, "int8" or "fp8"
    hybrid_kv: bool = False  # a block table per KV group, sliding groups keep their window (core/kv_groups.py)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    # waiting order and victim choice (core/cost_policy.py); these defaults are EngineArgs' too
    scheduling_policy: str = "priority"  # fcfs | priority | predicted
    scheduling_aging_s: float = 120.0  # predicted: never passed over by a request arriving this much later
    scheduling_max_passed_over: int = 20  # predicted: nor by more than this many later arrivals
    length_predictor: str | None = None  # its directory (treadle/predict); None: requests carry no prediction


@dataclass(frozen=True)
class ParallelConfig:
    distributed_executor_backend: str  # "uni" (in-process) | "mp" (worker processes) | "ray" (actors)
    tensor_parallel_size: int
    pipeline_parallel_size: int
    comm_overlap: bool  # TP: two micro-batches per step, all-reduces overlapped with compute
    # MoE under TP: each rank holds E / T whole experts (else: every expert, 1 / T of its columns)
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


SPEC_METHODS = ("ngram", "draft_model", "eagle", "medusa")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` names), resolved: the proposer
    (``method``), K drafts per verify, the n-gram window, and whether the fallback controller
    may turn speculation off where it does not pay."""

    method: str  # "ngram" | "draft_model" | "eagle" | "medusa"
    num_speculative_tokens: int  # K
    prompt_lookup_min: int
    prompt_lookup_max: int
    fallback: bool
    model: str | None = None  # draft_model: the draft's path or name (None: layer-skip); eagle / medusa: the head's directory
    draft_layers: int | None = None  # draft_model "self:N": the target's first N layers are the draft

    @property
    def lookahead_slots(self) -> int:
        """KV slots the scheduler reserves past each scheduled chunk: a proposer with its own
        KV (every method but ngram and medusa) writes its K - 1 drafts and the new token there."""
        return 0 if self.method in ("ngram", "medusa") else self.num_speculative_tokens


KV_CONNECTORS = ("tcp", "shm")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (vLLM's ``kv_transfer_config`` names), resolved.
    A producer serves the KV of finished ``do_remote_decode`` requests on ``ip:port``; a
    consumer pulls it for ``do_remote_prefill`` requests (``treadle/kv_transfer``)."""

    connector: str  # "tcp" | "shm"
    role: str  # "kv_producer" | "kv_consumer" | "kv_both"
    ip: str  # the producer's address, as consumers reach it
    port: int  # the producer's serving port (resolved: never 0)
    engine_id: str
    transfer_timeout_s: float  # consumer: a pull slower than this fails (the prompt is recomputed)
    producer_block_timeout_s: float  # producer: blocks nobody pulled are freed after this
    # consumer: a request runs in the step its load starts, each layer waiting for its KV to land
    # (False: it runs once its whole load is in)
    layerwise_start: bool

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str
    attention_backend: str  # a concrete backend name: "reference" | "cpu" | "triton"
    enforce_eager: bool  # True: no CUDA graphs (always True off CUDA)
    fused_layers: bool  # CPU: decoder layers swapped for the fused one-call layer where they can be
    speculative: SpeculativeConfig | None = None  # None: no speculation (the normal path)
    kv_transfer: KVTransferConfig | None = None  # None: no P/D disaggregation


def json_option(raw: dict[str, Any] | str | None, name: str, known: dict[str, Any],
                 example: str) -> dict[str, Any] | None:
    """A JSON-object option (a dict, or its JSON text from the CLI): None when unset or empty;
    not JSON, not an object, or an unknown key -> a one-line TreadleError naming ``name``."""
    if raw is None or raw == "" or raw == {}:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TreadleError(f"{name} is not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(raw, dict):
        raise TreadleError(f"{name} must be a JSON object, e.g. {example}")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise TreadleError(f"unknown {name} key {unknown[0]!r}; known: {', '.join(known)}")
    return raw
