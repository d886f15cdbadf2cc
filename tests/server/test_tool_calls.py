"""Tool calling on /v1/chat/completions through the official openai client: forced calls
(required, named) are always well formed, auto output is parsed (Hermes/Qwen tags and
Llama-3 JSON), streamed or not; the chat template receives the tools."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_harness import serve, stories_with_chat_template

from treadle.server.tools import ToolMode, parse_tool_calls, streamable
from treadle.tokenizer import Tokenizer

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_thread")]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
AUTO = ToolMode("auto", TOOLS)


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_parse_hermes_llama3_and_content() -> None:
    content, calls = parse_tool_calls(AUTO, 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": '
                                            '{"zone": "utc"}}\n</tool_call><tool_call>{"name": "get_weather", '
                                            '"arguments": {"city": "Oslo", "unit": "c"}}</tool_call>')
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    content, calls = parse_tool_calls(AUTO, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "cet"}
    assert parse_tool_calls(AUTO, "Just words.") == ("Just words.", [])
    assert parse_tool_calls(AUTO, "<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    assert parse_tool_calls(AUTO, '{"no": "name"}') == ('{"no": "name"}', [])


def test_streamable_holds_what_may_be_a_call() -> None:
    assert streamable(AUTO, "Hello there") == len("Hello there")
    assert streamable(AUTO, "Hello <tool") == len("Hello ")
    assert streamable(AUTO, "Hi <tool_call>{") == len("Hi ")
    assert streamable(AUTO, '  {"name"') == 0 and streamable(AUTO, "<|python") == 0
    assert streamable(ToolMode("required", TOOLS), "anything") == 0


def test_template_receives_tools(tmp_path) -> None:
    model = stories_with_chat_template(tmp_path / "m")
    tok = Tokenizer.from_hf_dir(model)
    tok.chat_template = ("{% for t in tools or [] %}<tool>{{ t.function.name }}</tool>{% endfor %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tok.apply_chat_template(MESSAGES, tools=TOOLS) == "<tool>get_weather</tool><tool>get_time</tool>" \
        "Weather in Paris?"


@pytest.fixture(scope="module", params=[False, True], ids=["engine-process", "in-process"])
def client(tmp_path_factory, request):
    with serve(stories_with_chat_template(tmp_path_factory.mktemp("stories")), in_process=request.param) as (srv, _):
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_required_is_always_well_formed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, n=4, temperature=1.0, seed=2, max_tokens=150)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _valid(choice.message.tool_calls[0])


def test_named_function_streamed_and_not(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                       temperature=1.0, seed=4, max_tokens=100)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    _valid(call)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                            temperature=1.0, seed=4, max_tokens=100, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    calls = [tc for ch in chunks for tc in (ch.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.arguments == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"
    assert not "".join(ch.delta.content or "" for ch in chunks)
    # no chunk says nothing: the role opens the stream, the call and finish_reason close it
    assert all(ch.delta.role or ch.delta.content or ch.delta.tool_calls or ch.finish_reason for ch in chunks)


def test_auto_parses_a_hermes_call_streamed_and_not(client: openai.OpenAI) -> None:
    """A grammar makes the tiny model write a Hermes-style call; auto mode must parse it."""
    grammar = ('root ::= "Sure. <tool_call>{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": \\"" '
               'z "\\"}}</tool_call>"\nz ::= "utc" | "cet"')
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=1,
              max_tokens=100, extra_body={"guided_grammar": grammar})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.content == "Sure." and r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_time"
    _valid(call)
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(ch.delta.content or "" for ch in chunks).strip() == "Sure."  # the space streamed before the tag
    calls = [tc for ch in chunks for tc in (ch.delta.tool_calls or [])]
    assert [c.function.arguments for c in calls] == [call.function.arguments]
    assert chunks[-1].finish_reason == "tool_calls"


def test_auto_and_none_leave_plain_text_alone(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           temperature=0.0, max_tokens=20)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_errors_are_400s(client: openai.OpenAI) -> None:
    cases = [dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
             dict(tool_choice="required"),
             dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **kw)
        assert e.value.body["param"] in ("tool_choice", "response_format"), e.value.body
