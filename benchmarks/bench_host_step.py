"""Host work of an engine decode step outside the model's forward, DeepSeek-V4 against DeepSeek-V3.2.

Tiny production-mode checkpoints (``deepseek_v4_tiny``: FP8 linears, FP4 experts; ``tiny``: FP8)
run through ``LLMEngine`` with async scheduling on the CPU (the forward runs the reference backends;
on a GPU the decode forward would be a graph replay, which neither times nor counts it). For batch 1 and 32 (prompts of 100 tokens, greedy) it
reports, per decode step:

- host ms outside the forward: the step's wall time minus the time inside ``model.forward``,
  median over ``--steps`` steps. This is what a GPU host also pays (scheduler, metadata, sampling
  bookkeeping, output processing); on a GPU a CUDA graph replaces the forward, and its staging of
  the step's inputs is not included here.
- model-code device ops: the tensor ops that launch a kernel (views and allocations left out) issued
  by the model's own code (``flashdsa/models``) in one decode forward, counted with a
  ``TorchDispatchMode``. In a CUDA-graph decode each is a graph node: the host's cudaGraphLaunch and
  the GPU's gaps between nodes grow with them. The kernels' own launches (``flashdsa/runtime``) are
  left out: on CPU they are the reference backends' torch ops, not the GPU's kernel count.

The ratio column is V4's model-code ops over V3.2's at the same batch (layers: V4 4, V3.2 3).

    python3 -m benchmarks.bench_host_step [--steps 40] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import statistics
import tempfile
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.common import Row, output_parser, report
from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint
from flashdsa.models.loader import load_model
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.sampling_params import SamplingParams

BATCHES = (1, 32)
PROMPT = 100
NO_KERNEL = {"view", "_unsafe_view", "alias", "as_strided", "slice", "select", "expand", "unsqueeze", "squeeze",
             "t", "transpose", "permute", "detach", "reshape", "split", "unbind", "split_with_sizes", "lift_fresh",
             "empty", "empty_strided", "empty_like", "new_empty", "diagonal", "unfold", "narrow", "_local_scalar_dense"}


class ModelOps(TorchDispatchMode):
    """Counts the kernel-launching ops whose innermost flashdsa frame is in ``flashdsa/models``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL and (name.endswith("_") or not _aliases(out, (args, kwargs))):
            frames = [f.filename for f in traceback.extract_stack() if "/flashdsa/" in f.filename]
            self.count += bool(frames) and "/flashdsa/models/" in frames[-1]
        return out


def _aliases(out, inputs) -> bool:
    """Whether ``out`` shares storage with an input (a no-op ``.to``/``contiguous``: no kernel)."""
    if not isinstance(out, torch.Tensor):
        return False
    storages = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    return out.untyped_storage().data_ptr() in storages


def tiny_model(arch: str, path: str, device: str):
    if arch == "V4":
        return load_v4_model(make_tiny_v4_checkpoint(path, fp8=True, fp4_experts=True, seed=1), device, mode="production")
    return load_model(make_tiny_checkpoint(path, fp8=True, seed=1), device, mode="production")


def measure(model, tokenizer, batch: int, steps: int) -> tuple[float, float, float, int]:
    """(step ms, forward ms, host ms outside the forward, model-code ops of one decode forward)."""
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=PROMPT * batch,
                                                      max_model_len=PROMPT + steps + 16, async_scheduling=True))
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), torch.randint(3, 400, (PROMPT,), generator=gen).tolist(), params)
    for _ in range(3):  # the prefill, then decode steps
        engine.step()
    inside, counter = [0.0], [None]
    forward = model.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            if counter[0] is None:
                return forward(*args, **kwargs)
            with counter[0]:
                return forward(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start

    model.forward = timed
    try:
        counter[0] = ModelOps()
        engine.step()
        ops, counter[0] = counter[0].count, None
        walls, forwards = [], []
        for _ in range(steps):
            inside[0] = 0.0
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            forwards.append(inside[0])
    finally:
        del model.forward
    host = statistics.median(w - f for w, f in zip(walls, forwards))
    return statistics.median(walls) * 1e3, statistics.median(forwards) * 1e3, host * 1e3, ops


def main() -> None:
    parser = output_parser(__doc__)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per point")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    device = "cpu"
    found = {}
    for arch in ("V4", "V3.2"):
        with tempfile.TemporaryDirectory() as tmp:
            model = tiny_model(arch, tmp, device)
            tokenizer = AutoTokenizer.from_pretrained(tmp)
        for batch in BATCHES:
            found[arch, batch] = measure(model, tokenizer, batch, args.steps)
    rows = []
    for (arch, batch), (step, forward, host, ops) in found.items():
        base = found["V3.2", batch][3]
        rows.append(Row(f"decode step host time outside the forward ({arch})", f"b={batch}", host, ops,
                        "model ops", base, f"step {step:.2f} ms, forward {forward:.2f} ms ({device}); ratio: "
                        f"model-code device ops per step over V3.2's"))
    report(f"Host work of a decode step, tiny production models on {device}", rows, args.output)


if __name__ == "__main__":
    main()
