"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from treadle.config import TreadleError
from treadle.engine.args import EngineArgs
from treadle.engine.inputs import PromptType
from treadle.engine.llm_engine import LLMEngine
from treadle.engine.outputs import RequestOutput
from treadle.sampling_params import SamplingParams


class LLM:
    """An engine for offline batches. Keyword arguments are ``EngineArgs`` fields, named as
    vLLM's ``LLM``: dtype, max_model_len, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill, seed, device, distributed_executor_backend, ..."""

    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_args(model, **kwargs)
        self._ids = itertools.count()
        self._streams: dict[str, deque[RequestOutput]] = {}  # outputs for each open stream()
        self._finished: dict[str, RequestOutput] = {}  # final outputs nobody has collected yet

    def shutdown(self) -> None:
        """Stop the engine's workers now (they also stop when the LLM is collected or at exit)."""
        self.engine.shutdown()

    def get_stats(self) -> dict[str, Any]:
        """The engine's counters so far: steps, preemptions, tokens, and with speculation
        ``spec_decode`` (drafted / accepted / emitted tokens, mean acceptance length,
        acceptance by position, fallbacks and probes)."""
        return self.engine.stats.as_dict()

    def get_tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence):
            raise TreadleError(f"prompts must be a prompt or a list of prompts, not {type(prompts).__name__}")
        prompts = cast(list[PromptType], list(prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, Sequence) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise TreadleError("give one SamplingParams, or one per prompt")
        else:
            raise TreadleError("sampling_params must be a SamplingParams or a list of them, "
                               f"not {type(sampling_params).__name__}")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            if priority is not None and len(priority) != len(prompts):
                raise TreadleError(f"give one priority per prompt: {len(priority)} for {len(prompts)} prompts")
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0, fit_max_tokens=True)
            return self.collect(ids, use_tqdm)
        finally:  # all or nothing: a refused prompt (or a failed step) leaves none of this call queued
            self.engine.abort_request(ids)
            for rid in ids:
                self._finished.pop(rid, None)

    def collect(self, request_ids: Sequence[str], use_tqdm: bool = False) -> list[RequestOutput]:
        """Step the engine until every one of ``request_ids`` has finished; their final
        outputs in that order. Requests added with ``llm.engine.add_request`` can be
        collected here too, also when they finished while ``stream`` was being iterated
        (their final outputs are kept until collected)."""
        wanted = set(request_ids)
        with tqdm(total=len(wanted), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            left = wanted - self._finished.keys()
            bar.update(len(wanted) - len(left))
            while left:
                if not self.engine.has_unfinished_requests():
                    raise TreadleError(f"no such request(s) in the engine: {sorted(left)}")
                done = {out.request_id for out in self._step() if out.finished} & left
                left -= done
                bar.update(len(done))
        return [self._finished.pop(rid) for rid in request_ids]

    def _step(self) -> list[RequestOutput]:
        """One engine step; every output is routed (a stream's buffer, or ``_finished``)
        so no caller loses the outputs of another."""
        outs = self.engine.step()
        for out in outs:
            buffer = self._streams.get(out.request_id)
            if buffer is not None:
                buffer.append(out)
            elif out.finished:
                self._finished[out.request_id] = out
        return outs

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, through the model's chat template
        (``tools``: OpenAI tool definitions handed to the template, as vLLM's ``LLM.chat``)."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[list[dict[str, Any]]], [messages] if one else messages)
        tok = self.engine.tokenizer_for("chat")
        texts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tools=tools)
                 for c in conversations]
        prompts = [{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput each step the request advances (``new_text`` holds the delta).
        Other requests already in the engine keep running alongside."""
        rid = str(next(self._ids))
        self.engine.add_request(rid, prompt, sampling_params, fit_max_tokens=True)
        buffer: deque[RequestOutput] = deque()
        self._streams[rid] = buffer
        try:
            while True:
                while not buffer:
                    self._step()
                out = buffer.popleft()
                yield out
                if out.finished:
                    return
        finally:
            del self._streams[rid]
            self.engine.abort_request(rid)
