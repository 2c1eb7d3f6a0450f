"""Offline Python API: `LLM(model_dir).generate(prompts, params, adapters=[...])`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from loraplex.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    LoRAConfig,
    SchedulerConfig,
)
from loraplex.engine.engine import Engine
from loraplex.types import AdapterRef, RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        max_lora_rank: int = 64,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        cuda_graph_max_batch: int = 256,
        cuda_graph_max_tokens: int | None = None,
        progress: bool = False,
        adapter_device_bytes: int | None = None,
        adapter_host_bytes: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        config = EngineConfig(
            model_dir=str(model),
            dtype=dtype,
            device=device,
            seed=seed,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_kv_blocks,
                max_model_len=max_model_len,
                enable_prefix_caching=enable_prefix_caching,
            ),
            lora=LoRAConfig(
                max_rank=max_lora_rank,
                adapter_device_bytes=adapter_device_bytes,
                adapter_host_bytes=adapter_host_bytes,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
            graphs=GraphConfig(
                cuda_graph_max_batch=cuda_graph_max_batch, cuda_graph_max_tokens=cuda_graph_max_tokens
            ),
        )
        self._attach(Engine(config, progress=progress))

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = False) -> LLM:
        llm = cls.__new__(cls)
        llm._attach(Engine(config, progress=progress))
        return llm

    def _attach(self, engine: Engine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 (a transformers tokenizer, or None)
        return self.engine.tokenizer

    def register_adapter(self, name: str, path: str | Path) -> AdapterRef:
        """Import a PEFT adapter; returns its immutable revision. Raises ValueError naming the problem."""
        return self.engine.register_adapter(name, path)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | AdapterRef | None | Sequence[str | AdapterRef | None] = None,
        cache_salt: str | None | Sequence[str | None] = None,
        priority: int | Sequence[int] = 0,
        deadline_s: float | None | Sequence[float | None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs come back in prompt order.

        `adapters` gives, per prompt, None (base model), a name (its latest revision) or
        `name@revision`; a single value applies to every prompt. `cache_salt` (one, or one per
        prompt): only requests with the same salt share prefix-cache blocks. `priority` (one, or
        one per prompt): admission order under the adaptive scheduler policy (higher first).
        `deadline_s` (one, or one per prompt; None: none): the first token's deadline in seconds,
        which the adaptive policy admits ahead of fairness as it nears.
        Every request is validated and resolved before any runs, so one bad entry raises
        ValueError and nothing runs.
        """
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]  # one prompt: text or token ids
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        params = _per_prompt(sampling_params or SamplingParams(), len(batch), SamplingParams)
        adapter_specs = _per_prompt(adapters, len(batch), (str, AdapterRef, type(None)))
        salts = _per_prompt(cache_salt, len(batch), (str, type(None)))
        priorities = _per_prompt(priority, len(batch), int)
        deadlines = _per_prompt(deadline_s, len(batch), (int, float, type(None)))
        request_ids = [f"gen-{next(self._ids)}" for _ in batch]
        engine = self.engine
        added: list[str] = []
        try:
            for rid, prompt, p, a, salt, pri, due in zip(
                request_ids, batch, params, adapter_specs, salts, priorities, deadlines, strict=True
            ):
                engine.add_request(rid, prompt, p, a, salt, priority=pri, deadline_s=due)
                added.append(rid)
        except Exception:
            for rid in added:
                engine.abort(rid)
                engine.release(rid)
            raise
        while any(not engine.output(rid).finished for rid in request_ids):
            engine.step_overlapped()
        outputs = [engine.output(rid) for rid in request_ids]
        for rid in request_ids:
            engine.release(rid)
        return outputs


def _per_prompt(value, n: int, single_types) -> list:  # noqa: ANN001
    if isinstance(value, single_types):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} entries for {n} prompts")
    return values
