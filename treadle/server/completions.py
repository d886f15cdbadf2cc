"""POST /v1/completions: one or many prompts (text or token ids), n choices each,
streamed as server-sent events or returned whole; legacy logprobs and echo."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from treadle.engine.inputs import PromptType
from treadle.engine.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.server.errors import APIError
from treadle.server.generation import GenerationView, prompt_index, prompt_logprobs_json
from treadle.server.openapi import GENERATION_RESPONSES
from treadle.server.protocol import CompletionRequest, CompletionResponse
from treadle.server.state import ServerState
from treadle.tokenizer import Tokenizer

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _CompletionView(request.app.state.treadle, body).respond(request)


def legacy_logprobs(tokenizer: Tokenizer | None, ids: list[int], entries: list[dict[int, Logprob] | None],
                    text_offset: int) -> dict[str, list[Any]]:
    """OpenAI's completions shape: tokens, token_logprobs, top_logprobs, text_offset.
    An entry of None (the first prompt token) has no logprob. top_logprobs maps token text
    to logprob; where two tokens share a text (byte pieces), the later ones are keyed
    ``token_id:N`` so no entry is lost."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, entry in zip(ids, entries):
        chosen = entry.get(tid) if entry else None
        if chosen and chosen.decoded_token is not None:
            text = chosen.decoded_token
        else:
            text = "" if tokenizer is None else tokenizer.token_text(tid)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen else None)
        top: dict[str, float] = {}
        for top_id, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0) if entry else []:
            key = lp.decoded_token or ""
            top[f"token_id:{top_id}" if key in top else key] = lp.logprob
        tops.append(top if entry else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


class _CompletionView(GenerationView):
    id_prefix = "cmpl"
    object_name = chunk_object = "text_completion"
    prompt_param = "prompt"
    body: CompletionRequest

    def __init__(self, state: ServerState, body: CompletionRequest) -> None:
        super().__init__(state, body)
        self.tokenizer = state.llm.tokenizer
        self._offsets: dict[int, int] = {}  # streamed text so far, per choice
        # max_tokens 0 with echo (how scoring tools ask for a prompt's logprobs): the engine
        # makes one token, which is never shown; the choice is the prompt, finish_reason "length"
        self.echo_only = body.echo and body.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        body = self.body
        if body.suffix:
            raise APIError.bad_request("suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError.bad_request("best_of must equal n (or be left out)", "best_of")
        if not body.prompts():
            raise APIError.bad_request("prompt must not be empty", "prompt")
        max_tokens = 1 if self.echo_only else body.max_tokens
        return self.make_params(max_tokens, body.logprobs, body.logprobs if body.echo else None)

    def num_prompts(self) -> int:
        return len(self.body.prompts())

    def prompts(self) -> list[PromptType]:
        max_len = self.state.llm.max_model_len
        out: list[PromptType] = []
        for p in self.body.prompts():
            if isinstance(p, str):
                out.append(self.tokenized(p, self.body.add_special_tokens))
            elif len(p) > max_len:
                raise APIError(400, f"the prompt has {len(p)} tokens, more than max_model_len ({max_len})",
                               "prompt", "context_length_exceeded")
            else:
                out.append(p)
        return out

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None or self.tokenizer is None:
            return out.prompt or ""
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def choice_index(self, out: RequestOutput, c: CompletionOutput) -> int:
        return prompt_index(out.request_id) * self.body.n + c.index

    def completion_tokens(self, c: CompletionOutput) -> int:
        return 0 if self.echo_only else len(c.token_ids)

    def choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        prefix = self.prompt_text(out) if self.body.echo else ""
        new = 0 if self.echo_only else len(c.token_ids)
        logprobs = None
        if self.body.logprobs is not None:
            ids = list(c.token_ids[:new])
            entries: list[dict[int, Logprob] | None] = list((c.logprobs or [])[:new])
            if self.body.echo:
                ids, entries = list(out.prompt_token_ids) + ids, self._prompt_entries(out) + entries
            logprobs = legacy_logprobs(self.tokenizer, ids, entries, 0)
        choice = {"index": self.choice_index(out, c), "text": prefix + (c.text if new else ""),
                  "logprobs": logprobs, "finish_reason": "length" if self.echo_only else c.finish_reason,
                  "stop_reason": None if self.echo_only else c.stop_reason}
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(out)
        return choice

    @staticmethod
    def _prompt_entries(out: RequestOutput) -> list[dict[int, Logprob] | None]:
        """One entry per prompt token (the first has none)."""
        entries = list(out.prompt_logprobs or [])[: len(out.prompt_token_ids)]
        return entries + [None] * (len(out.prompt_token_ids) - len(entries))

    def first_output_chunks(self, out: RequestOutput) -> list[str]:
        if not self.body.echo:
            return []
        text = self.prompt_text(out)
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = legacy_logprobs(self.tokenizer, list(out.prompt_token_ids), self._prompt_entries(out), 0)
        for c in out.outputs:  # the generated tokens' offsets continue after the echoed prompt
            self._offsets[self.choice_index(out, c)] = len(text)
        return [self.chunk([{"index": self.choice_index(out, c), "text": text, "logprobs": logprobs,
                             "finish_reason": None}]) for c in out.outputs]

    def delta(self, out: RequestOutput, c: CompletionOutput, index: int) -> dict[str, Any]:
        if self.echo_only:  # the prompt went in the first chunk; the one hidden token ends it
            return {"index": index, "text": "", "logprobs": None,
                    "finish_reason": "length" if c.finish_reason else None, "stop_reason": None}
        logprobs = None
        offset = self._offsets.get(index, 0)
        if self.body.logprobs is not None:
            end = len(c.token_ids)
            start = end - len(c.new_token_ids)
            entries: list[dict[int, Logprob] | None] = list((c.logprobs or [])[start:end])
            logprobs = legacy_logprobs(self.tokenizer, list(c.new_token_ids), entries, offset)
        self._offsets[index] = offset + len(c.new_text)
        return {"index": index, "text": c.new_text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
