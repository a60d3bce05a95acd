"""The request contract: what a request can ask for and what it gets back, in one torch-free folder that the
router, the workers and the engine all import (the engine's own bookkeeping of a request is engine/core/request.py).

    sampling_params.py   SamplingParams: the parameters, their defaults and checks (vLLM's names), and the field
                         table that the proto conversion, `generate`'s flags and the router's body copy read
    grammar_spec.py      GrammarSpec: the grammar a request's output must follow (structured outputs)
    logprobs.py          TokenLogprobs: the logprobs of one token, as handed back
    stop_reason.py       StopReason: the stop token id or stop string that ended a request
    wire.py              all of them <-> their protobuf messages (protos/serving.proto)

Nothing here imports torch or any other part of the engine (tests/engine/test_layering.py); this file imports
nothing.
"""
