"""Synchronous generation for scripts: ``LLM(path).generate(prompts, params)`` and
``LLM().chat(messages, params)`` (the embedded default model without a path)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm import tqdm

from flashdsa.errors import blame
from flashdsa.models.chat_template import apply_chat_template
from flashdsa.runtime.engine import EngineConfig, LLMEngine, RequestOutput
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.sequence import TokenLogprobs

Prompt = Union[str, list[int]]
Messages = list[dict[str, Any]]  # one conversation: [{"role": "user", "content": "..."}, ...]


def render_chat(tokenizer, messages: Messages, add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """``messages`` rendered by the tokenizer's chat template (DeepSeek-V3.2's when it has none):
    (text, token ids). The template writes its own special tokens, so the tokenizer adds none."""
    text = apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    return text, tokenizer(text, add_special_tokens=False).input_ids


@dataclass
class Completion:
    """One of the n choices generated for a prompt."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[str, int]] = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


@dataclass
class GenerateResult:
    prompt: Prompt
    prompt_token_ids: list[int]
    outputs: list[Completion]
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None


class LLM:
    """A model and its engine. ``model`` is a checkpoint directory, a Hugging Face repo id (see
    :mod:`flashdsa.models.resolve`), None for the embedded default model, or a loaded model (then
    pass its tokenizer). ``device`` defaults to CUDA when present. ``quantization="fp8"`` stores a
    bf16 checkpoint's linear layers as FP8; ``tensor_parallel_size=N`` runs it on N ranks (one
    process each; this one is rank 0), with the routed experts split over them under
    ``enable_expert_parallel``. Engine options (max_num_seqs, num_blocks, max_model_len,
    enforce_eager, speculative_tokens, async_scheduling, ...) go to EngineConfig;
    ``speculative_tokens=1`` also loads the checkpoint's MTP layer. Bad arguments raise ValueError
    naming them."""

    def __init__(
        self,
        model: Union[str, Path, torch.nn.Module, None] = None,
        tokenizer=None,
        *,
        device: Union[str, torch.device, None] = None,
        mode: str = "production",
        quantization: Optional[str] = None,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        **engine_options,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            from flashdsa.models.resolve import open_model
            from flashdsa.runtime.parallel.shard import ParallelConfig

            with blame("tensor_parallel_size"):
                parallel = ParallelConfig(tensor_parallel_size, enable_expert_parallel)
            model, own_tokenizer = open_model(model, device, mode, quantization, parallel,
                                              mtp=engine_options.get("speculative_tokens", 0) > 0)
            tokenizer = tokenizer or own_tokenizer
        elif tokenizer is None:
            raise ValueError("tokenizer: pass the tokenizer of a loaded model")
        self.tokenizer = tokenizer
        self.engine = LLMEngine(model, tokenizer, EngineConfig(**engine_options))

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel model (also done at exit)."""
        workers = getattr(self.engine.runner.model, "workers", None)
        if workers is not None:
            workers.stop()

    def generate(
        self,
        prompts: Union[Prompt, list[Prompt]],
        params: Optional[SamplingParams] = None,
        use_tqdm: bool = True,
    ) -> list[GenerateResult]:
        """Generate for every prompt (strings or token-id lists); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(list(prompts), encoded, params or SamplingParams(), use_tqdm)

    def chat(
        self,
        messages: Union[Messages, list[Messages]],
        params: Optional[SamplingParams] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[GenerateResult]:
        """Reply to one conversation or to each of a list of them, rendered by the tokenizer's
        chat template; each result's ``prompt`` is the rendered text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [render_chat(self.tokenizer, c, add_generation_prompt) for c in conversations]
        return self._run([text for text, _ in rendered], [ids for _, ids in rendered], params or SamplingParams(),
                         use_tqdm)

    def _run(self, prompts: list[Prompt], encoded: list[list[int]], params: SamplingParams,
             use_tqdm: bool) -> list[GenerateResult]:
        """Queue every prompt's n choices, step the engine until all finish; results in prompt order."""
        results, choices = [], {}
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            result = GenerateResult(prompt, ids, [Completion(j) for j in range(params.n)])
            for j, completion in enumerate(result.outputs):
                self.engine.add_request(f"{i}-{j}", ids, params.for_choice(j))
                choices[f"{i}-{j}"] = (result, completion)
            results.append(result)
        with tqdm(total=len(choices), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    result, completion = choices[out.request_id]
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    completion.add(out)
                    bar.update(int(out.finished))
        return results
