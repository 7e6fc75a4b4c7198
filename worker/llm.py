"""``LLM``: the offline Python API, in the style of vLLM.

    from worker import LLM, SamplingParams
    llm = LLM(model="smollm2", num_kv_blocks=2048)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].text, outs[0].num_cached_tokens)

Prompts may be strings (tokenised without special tokens) or lists of token ids. Outputs come
back in the order of the prompts. A progress bar shows while more than one request runs.
Without ``params``, ``generate`` and ``chat`` use ``get_default_sampling_params()``: the model's
generation_config.json defaults (``generation_config``), as vLLM's ``LLM`` does.

``LLM(..., tensor_parallel_size=N)`` starts N-1 local worker processes (fresh interpreters,
so a plain script needs no ``if __name__ == "__main__":`` guard). ``shutdown()`` (or leaving a
``with LLM(...) as llm:`` block) ends them; so do the ``LLM`` being garbage-collected and the
interpreter exiting with it still open, quietly; and a worker whose parent process died ends
on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.generation_defaults import load_generation_defaults
from worker.loader import load_tokenizer
from worker.outputs import RequestOutput
from worker.parallel.workers import WorkerLauncher
from worker.sampling_params import SamplingParams


class LLM:
    def __init__(
        self, model: str = "smollm2", *, launcher: WorkerLauncher | None = None, **engine_options
    ):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), launcher=launcher)
        config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        if config.chat_template is not None:  # the engine's own tokenizer never renders templates
            self.tokenizer = load_tokenizer(config, model_path=self.engine.model_path)
        self._default_params = load_generation_defaults(config, self.engine.model_path)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no params: the model's generation_config.json
        defaults (``generation_config``, as in vLLM) over SamplingParams' own."""
        return SamplingParams(**self._default_params)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_name``: the LoRA adapter every prompt runs on, or one per prompt (None: the
        base model); adapters come from ``lora_modules``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        loras = (
            list(lora_name) if isinstance(lora_name, (list, tuple)) else [lora_name] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora names for {len(prompts)} prompts")
        params_list = (
            params
            if isinstance(params, (list, tuple))
            else [params or self.get_default_sampling_params()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        order = []
        for prompt, p, lora in zip(prompts, params_list, loras, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, p, lora_name=lora)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(order), desc="generating", unit="req", disable=not use_tqdm or len(order) < 2
        )
        for outputs in self.engine.steps():
            for out in outputs:
                if out.finished:
                    done[out.request_id] = out
                    bar.update()
        bar.close()
        return [done[rid] for rid in order]

    def shutdown(self) -> None:
        """Ends the tensor-parallel workers, if any. The LLM cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        ids = self.tokenizer.apply_chat_template(messages)
        return self.generate([ids], params, use_tqdm=False)[0]
