"""`treadle generate` (one-shot, streamed to stdout) and `treadle chat` (interactive)."""
from __future__ import annotations

import argparse
import sys

from treadle.engine.cli_args import add_engine_args, add_sampling_args, engine_kwargs, sampling_kwargs
from treadle.sampling_params import SamplingParams


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate a completion for a prompt")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
    g.add_argument("prompt", nargs="+", help="the prompt text")
    g.set_defaults(func=run_generate)
    c = sub.add_parser("chat", help="interactive chat with streamed replies")
    add_engine_args(c)
    add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=run_chat)


def _make_llm(args: argparse.Namespace):  # noqa: ANN202
    from treadle.entrypoints.llm import LLM

    kw = engine_kwargs(args)
    return LLM(kw.pop("model"), **kw)


def run_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = SamplingParams(**sampling_kwargs(args, default_temperature=0.0))
    text = " ".join(args.prompt)
    prompt: str | dict = text
    if args.chat_template:
        tok = llm.get_tokenizer()
        templated = tok.apply_chat_template([{"role": "user", "content": text}])
        prompt = {"prompt": templated, "prompt_token_ids": tok.encode(templated, add_special_tokens=False)}
    else:
        print(text, end="", flush=True)
    for out in llm.stream(prompt, params):
        print(out.outputs[0].new_text, end="", flush=True)
    print()
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = SamplingParams(**sampling_kwargs(args, default_temperature=0.7))
    tok = llm.get_tokenizer()
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model; an empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        templated = tok.apply_chat_template(history, add_generation_prompt=True)
        prompt = {"prompt": templated, "prompt_token_ids": tok.encode(templated, add_special_tokens=False)}
        print("assistant> ", end="", flush=True)
        reply = ""
        for out in llm.stream(prompt, params):
            print(out.outputs[0].new_text, end="", flush=True)
            reply = out.outputs[0].text
        print()
        history.append({"role": "assistant", "content": reply})
    return 0
