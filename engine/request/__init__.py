"""The request contract: what a request can ask for and what it gets back, in one torch-free folder that the
router, the workers and the engine all import (the engine's own bookkeeping of a request is engine/core/request.py).

    sampling_params.py   SamplingParams: the parameters, their defaults and checks (vLLM's names)
    grammar_spec.py      GrammarSpec: the grammar a request's output must follow (structured outputs)
    logprobs.py          TokenLogprobs: the logprobs of one token, as handed back

Nothing here imports torch or any other part of the engine; this file imports nothing.
"""
