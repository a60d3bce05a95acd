"""Structured outputs: a request's grammar (JSON schema, JSON, regex, choice, EBNF) constrains every token it
samples, through xgrammar.

    compiler.py   GrammarCompilerCache: spec -> xgrammar CompiledGrammar, once per spec (LRU); the errors that
                  make a bad spec a 400
    matchers.py   GrammarMatchers: one matcher per running request, kept in step with its output tokens; fills
                  the step's token bitmask for the whole batch, and truncates draft tokens the grammar rejects
    bitmask.py    TokenBitmask and applying it to a batch of logits (xgrammar's kernel; a torch reference);
                  PendingBitmask, one still being filled
    fill_ahead.py FillAhead: the matchers' own thread, which fills a cuda step's bitmask while its forward runs

What a request asks for, `GrammarSpec`, is part of the torch-free request contract (engine/request/grammar_spec.py);
this file imports nothing.
"""
