"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader.model_registry import resolve_model
from engine.request.lora import LoRARequest
from engine.outputs import RequestOutput
from engine.request.generation_config import AUTO, GenerationDefaults, load_generation_defaults
from engine.request.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Batch generation over one in-process engine. Keyword arguments are `EngineConfig` fields, and vLLM's
    `generation_config` ("auto": the model's generation_config.json, if it has one; "vllm": none; or a folder
    holding one) and `override_generation_config` (a dict of the same keys over it), which give
    `get_default_sampling_params()`: what `generate` and `chat` sample with when given no SamplingParams."""

    def __init__(self, model: str = "smollm2-135m", *, generation_config: str = AUTO,
                 override_generation_config: Mapping[str, object] | None = None, **engine_args: object) -> None:
        config = EngineConfig(model=model, **engine_args)  # type: ignore[arg-type]
        override = override_generation_config
        # Checked before the weights load: a folder without the file, an override that does not parse. The model's
        # own file ("auto") is read once the engine has found the model (its device checked, its weights loaded).
        defaults = load_generation_defaults(generation_config, None, override)
        self.engine = LLMEngine(config)
        if generation_config == AUTO and config.load_format != "dummy":
            defaults = load_generation_defaults(AUTO, resolve_model(config.model), override)
        self.generation_defaults: GenerationDefaults = defaults
        self._ids = itertools.count()

    def reset_prefix_cache(self) -> bool:
        """As vLLM's: forget the cached KV blocks (False, nothing changed, while a request holds blocks)."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """As vLLM's: SamplingParams() with the model's generation config over it (its sampling values, and its
        max_new_tokens as max_tokens)."""
        defaults = self.generation_defaults
        cap = {} if defaults.max_new_tokens is None else {"max_tokens": defaults.max_new_tokens}
        return SamplingParams(**defaults.sampling, **cap)  # type: ignore[arg-type]

    @property
    def tokenizer(self):  # noqa: ANN201 - the engine's Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *, priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in input order. A prompt is text or a list of token ids. `priority`
        (vLLM's): one per prompt, lower first; it needs `scheduling_policy="priority"`. `lora_request` (vLLM's, with
        `enable_lora=True`): the LoRA adapter of every prompt, or one per prompt (None: the base model).

        All prompts are validated before any is queued, so a bad one raises without touching the engine.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = self.get_default_sampling_params()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
            per_prompt = [dataclasses.replace(p, priority=rank) for p, rank in zip(per_prompt, priority, strict=True)]
        for p in per_prompt:
            p.validate()
            if p.num_sequences > 1:  # one finished output per prompt is this API's contract
                raise ValueError("n > 1 and best_of are served by the workers' Generate stream, not LLM.generate")
        loras = self._lora_names(lora_request, len(prompts))
        requests = [
            self.engine.make_request(f"offline-{next(self._ids)}", prompt, p, lora_name=lora)
            for prompt, p, lora in zip(prompts, per_prompt, loras, strict=True)
        ]
        added: list[str] = []
        try:
            for request in requests:
                self.engine.enqueue(request)
                added.append(request.request_id)
        except BaseException:
            self.engine.abort_request(added)
            raise
        return self._run([r.request_id for r in requests])

    def chat(
        self,
        conversations: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *, add_generation_prompt: bool = True, continue_final_message: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with the generation prompt, or, as vLLM's
        `continue_final_message` with `add_generation_prompt=False`, ending inside the last message), then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(
                c, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message),
                add_special_tokens=False)
            for c in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, params, lora_request=lora_request)

    def _lora_names(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
                    ) -> list[str | None]:
        """Each prompt's adapter name, the adapters not loaded yet loaded."""
        per_prompt = [lora_request] * num_prompts if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(per_prompt) != num_prompts:
            raise ValueError(f"got {len(per_prompt)} LoRA requests for {num_prompts} prompts")
        loras = self.engine.loras
        if loras is None:
            if any(r is not None for r in per_prompt):
                raise ValueError("a LoRA request needs an engine with enable_lora=True")
            return [None] * num_prompts
        return [None if r is None else loras.resolve(r) for r in per_prompt]

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        try:
            while len(finished) < len(request_ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
        except BaseException:  # KeyboardInterrupt included: leave no request holding blocks
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        return [finished[r] for r in request_ids]
