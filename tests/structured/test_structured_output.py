"""Structured output: whatever the (tiny, gibberish-writing) model wants, the output parses
and validates, offline and through the official openai client; unconstrained requests in
the same batch are untouched; bad specs are one clear error."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_harness import ENGINE_KW, serve, stories_with_chat_template

from treadle import LLM, SamplingParams, StructuredOutputsParams
from treadle.config import TreadleError

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "kind": {"enum": ["hero", "villain"]},
    },
    "required": ["name", "age", "pets", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", 'a "quoted" maybe']
GRAMMAR = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-c] [a-c]? [a-c]?'  # bounded: always ends
PROMPTS = ["Once upon a time", "The little dog", "A"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return stories_with_chat_template(tmp_path_factory.mktemp("stories"))


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE_KW)


def _sampled(spec: StructuredOutputsParams, seed: int, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=120, structured_outputs=spec)


def test_every_kind_holds_offline(llm: LLM) -> None:
    cases = [(StructuredOutputsParams(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or 1 / 0),
             (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES or 1 / 0),
             (StructuredOutputsParams(grammar=GRAMMAR), lambda t: re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3}){0,2}\)", t) or 1 / 0)]
    for spec, check in cases:
        params = [_sampled(spec, seed) for seed in range(4)] + [_sampled(spec, 0, temperature=0.0)]
        outs = llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
        for out in outs:
            c = out.outputs[0]
            assert c.finish_reason == "stop", (spec.kind, c.text)
            check(c.text)


def test_json_object(llm: LLM) -> None:
    """Any JSON object: unbounded, so a story model fills strings until max_tokens (the one
    way a constrained output ends unparsed: finish_reason "length"). A stopped one parses."""
    spec = StructuredOutputsParams(json_object=True)
    outs = llm.generate(PROMPTS, [_sampled(spec, seed) for seed in range(3)], use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.text.startswith("{") and c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    grammar = StructuredOutputsParams(grammar='root ::= "{" "\\"k\\": " [0-9] "}"')
    out = llm.generate(PROMPTS[:1], _sampled(grammar, 0), use_tqdm=False)[0].outputs[0]
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop"


def test_unconstrained_rows_are_untouched(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS + PROMPTS, [free] * 3 + [_sampled(StructuredOutputsParams(json=SCHEMA), i)
                                                         for i in range(3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[3:]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_bad_specs_are_clear_errors(llm: LLM) -> None:
    for spec, words in [(dict(regex="[a-"), "invalid regex"), (dict(json={"type": "nonsense"}), "invalid JSON schema"),
                        (dict(json="{not json"), "not valid JSON"), (dict(grammar="root ::= undefined_rule"),
                                                                       "invalid grammar")]:
        with pytest.raises(TreadleError, match=words):
            llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)),
                         use_tqdm=False)
    with pytest.raises(TreadleError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(TreadleError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))


@pytest.mark.server
def test_mp_executor(model_dir) -> None:
    """The spec crosses to the worker process as plain data; the worker compiles it there."""
    llm = LLM(str(model_dir), distributed_executor_backend="mp", **ENGINE_KW)
    try:
        outs = llm.generate(PROMPTS, [_sampled(StructuredOutputsParams(json=SCHEMA), i) for i in range(3)],
                            use_tqdm=False)
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    finally:
        llm.engine.shutdown()


# -- through the official openai client ------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["engine-process", "in-process"])
def client(model_dir, request):
    with serve(model_dir, in_process=request.param) as (srv, _):
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_response_format_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Who?"}], n=3,
                                       temperature=1.0, seed=3, max_tokens=120, response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_streamed_json_object_and_schema(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "JSON!"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, temperature=1.0, seed=5,
                                            max_tokens=30, stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{")  # unbounded strings: see test_json_object
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    stream = client.chat.completions.create(model="tiny", messages=messages, temperature=1.0, seed=5,
                                            max_tokens=120, stream=True, response_format=fmt)
    chunks = [c for c in stream if c.choices]
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_vllm_fields(client: openai.OpenAI) -> None:
    extras = [({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
              ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
              ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
              ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3}){0,2}\)", t)),
              ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
              ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)]
    for extra, check in extras:
        r = client.completions.create(model="tiny", prompt=PROMPTS, temperature=1.0, seed=1, max_tokens=120,
                                      extra_body=extra)
        for choice in r.choices:
            assert choice.finish_reason == "stop" and check(choice.text), (extra, choice.text)


def test_invalid_specs_are_400s(client: openai.OpenAI) -> None:
    cases = [({"guided_regex": "(unclosed"}, "guided_regex"),
             ({"structured_outputs": {"json": {"type": 12}}}, "structured_outputs"),
             ({"guided_choice": []}, "guided_choice"),
             ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="A", max_tokens=5, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "required": 5}}})
    assert e.value.body["param"] == "response_format" and "required must be an array" in e.value.body["message"]
    assert ".cc" not in e.value.body["message"]


def test_speculation_leaves_constrained_requests_plain(llm: LLM, model_dir) -> None:
    """With n-gram speculation on, a constrained request gets no drafts (it decodes one masked
    token per step, so greedy output equals the plain engine's) while an unconstrained one in
    the same batch still speculates."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
             "fallback": False}
    spec_llm = LLM(str(model_dir), speculative_config=ngram, **ENGINE_KW)
    try:
        tok = spec_llm.get_tokenizer()
        free = {"prompt_token_ids": tok.encode("the cat sat on the mat. the cat sat on the mat. the cat")}
        specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
                 StructuredOutputsParams(grammar=GRAMMAR)]
        prompts = [*PROMPTS, free]
        params = [_sampled(s, 0, temperature=0.0) for s in specs]
        params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        got = spec_llm.generate(prompts, params, use_tqdm=False)
        want = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        jsonschema.validate(json.loads(got[0].outputs[0].text), SCHEMA)
        assert re.fullmatch(REGEX, got[1].outputs[0].text)
        assert spec_llm.get_stats()["spec_decode"]["draft_tokens"] > 0
    finally:
        spec_llm.engine.shutdown()
