"""Structured output: grammar compilation (cached, off the step loop) and token bitmasks.

    request (SamplingParams.structured_outputs: StructuredOutputsParams, plain data)
       |  front end (server tokenizer thread / LLMEngine.add_request): GrammarCompiler.compile
       |     -> invalid spec = InvalidRequestError (HTTP 400); a valid one lands in the cache
       v
    model runner: GrammarMatchers.add (cache hit in-process; a worker process compiles
       its own copy once per spec) -> each step mask(logits) before the sampler,
       accept(token) after it

The scheduler is untouched: a finished grammar allows only stop tokens, and the
ordinary EOS rule ends the request. Engine: xgrammar (see compiler.py for why).
"""
from treadle.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
