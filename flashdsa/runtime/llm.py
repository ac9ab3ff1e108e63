"""Synchronous generation for scripts: ``LLM(path).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch
from tqdm import tqdm

from flashdsa.runtime.engine import EngineConfig, LLMEngine, RequestOutput
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.sequence import TokenLogprobs

Prompt = Union[str, list[int]]


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
    """A model and its engine. ``model`` is a checkpoint directory or a loaded model (then
    pass its tokenizer); ``quantization="fp8"`` stores a bf16 checkpoint's linear layers as FP8;
    ``tensor_parallel_size=N`` runs it on N ranks (one process each; this one is rank 0), with
    the routed experts split over them under ``enable_expert_parallel``; engine options
    (max_num_seqs, num_blocks, enforce_eager, speculative_tokens, ...) go to EngineConfig;
    ``speculative_tokens=1`` also loads the checkpoint's MTP layer."""

    def __init__(
        self,
        model: Union[str, Path, torch.nn.Module],
        tokenizer=None,
        *,
        device: str = "cpu",
        mode: str = "production",
        quantization: Optional[str] = None,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        **engine_options,
    ) -> None:
        if isinstance(model, (str, Path)):
            from transformers import AutoTokenizer

            from flashdsa.runtime.parallel.launcher import load
            from flashdsa.runtime.parallel.shard import ParallelConfig

            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
            parallel = ParallelConfig(tensor_parallel_size, enable_expert_parallel)
            model = load(model, parallel, device, mode, quantization, mtp=engine_options.get("speculative_tokens", 0) > 0)
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
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        results, choices = [], {}
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
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
