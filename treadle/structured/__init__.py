"""Structured output: grammar compilation (cached, off the step loop) and token bitmasks.

    request (SamplingParams.structured_outputs: StructuredOutputsParams, plain data)
       |  server: CompileProbe.check (probe.py) builds the grammar (a bad spec is a 400) and
       |     compiles only a large one, in a killable child under the time budget
       |  engine (LLMEngine.compile_grammar, off the step loop): GrammarCompiler.compile into
       |     the shared cache, or with worker processes Executor.prepare_grammar: each worker
       |     compiles it in a thread beside its loop; the request is admitted when it is ready
       v
    model runner: GrammarMatchers.add (a cache hit) -> each step mask(logits) before the
       sampler, accept(token) after it

The scheduler is untouched: a finished grammar allows only stop tokens, and the
ordinary EOS rule ends the request. Engine: xgrammar (see compiler.py for why).
"""
from treadle.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
