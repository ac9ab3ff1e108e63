"""Per-step host microseconds of named pieces (graph forwards excluded), four configs, CPU."""
import sys, time, collections, statistics
from types import SimpleNamespace
import torch
from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.models.loader import load_model
from flashdsa.runtime import cuda_graphs, engine as engine_mod, metadata, model_runner, overlap, speculative, transfer, scheduler
from flashdsa.runtime.cuda_graphs import DecodeGraphs
from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.sampling_params import SamplingParams
from transformers import AutoTokenizer

torch.Tensor.pin_memory = lambda self: self
tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
model = load_model(DEFAULT_MODEL, device="cpu", mtp=True, mode="reference")
T = collections.defaultdict(float); stack = []
def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter(); stack.append(0.0)
        try: return f(*a, **k)
        finally:
            inner = stack.pop(); dt = time.perf_counter() - t
            T[name] += dt - (inner if name != "graph" else 0)  # self time only
            if stack: stack[-1] += dt
    return g
for mod, attr, name in [(metadata.Outcomes, "of", "Outcomes.of"), (overlap, "token_fill", "token_fill"),
                        (transfer.TokenFill, "apply", "TokenFill.apply"), (speculative.DeviceVerdict, "last_tokens", "last_tokens"),
                        (model_runner, "build_metadata", "build_metadata"), (scheduler.Scheduler, "schedule", "schedule"),
                        (engine_mod.LLMEngine, "_complete", "_complete"), (engine_mod.LLMEngine, "_process", "_process"),
                        (engine_mod.LLMEngine, "_commit", "_commit"), (DecodeGraphs, "replay", "replay(host)"),
                        (DecodeGraphs, "replay_draft", "replay_draft(host)"), (speculative, "verify_on_device", "verify_on_device"),
                        (overlap, "launch_verification", "launch_verification"), (overlap, "launch_sampling", "launch_sampling"),
                        (transfer.HostCopy, "__init__", "HostCopy"), (overlap, "overlappable", "overlappable")]:
    setattr(mod, attr, timed(name, getattr(mod, attr)))
engine_mod.token_fill = overlap.token_fill; engine_mod.launch_verification = overlap.launch_verification
engine_mod.launch_sampling = overlap.launch_sampling; engine_mod.overlappable = overlap.overlappable
model_runner.build_metadata = model_runner.build_metadata; overlap.verify_on_device = speculative.verify_on_device
def eager_graphs(engine, spec):
    r = engine.runner
    g = DecodeGraphs(r.model, r.caches, engine.config.max_num_seqs, engine.max_model_len, r.device, speculative=spec)
    g._fill_padding(0, g.max_batch); g.inputs.copy_(g.staging)
    for b in g.buckets:
        g.graphs[b] = SimpleNamespace(replay=timed("graph", lambda b=b: g.outputs.__setitem__(b, g._forward(b))))
        g.draft_graphs[b] = SimpleNamespace(replay=timed("graph", lambda b=b: g.draft_outputs.__setitem__(b, g._draft_forward(b))))
    r.graphs = g
ids = tok(open("/work/wt/mtpasync/README.md").read())["input_ids"][:64]
params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0)
res = collections.defaultdict(list)
for rep in range(3):
  for spec, ov in ((0, True), (1, True), (0, False), (1, False)):
    eng = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, max_num_batched_tokens=16384, max_model_len=512, num_blocks=16,
                    enable_prefix_caching=False, speculative_tokens=spec, async_scheduling=ov))
    eager_graphs(eng, spec > 0)
    eng.add_request("a", ids, params); [eng.step() for _ in range(3)]
    T.clear(); steps = 0; t = time.perf_counter()
    while eng.has_unfinished() and steps < 120:
        eng.step(); steps += 1
    wall = time.perf_counter() - t
    name = f"{'MTP' if spec else 'plain'} {'async' if ov else 'sync'}"
    res[name].append({"host total": (wall - T["graph"]) / steps * 1e6, **{k: v / steps * 1e6 for k, v in T.items() if k != "graph"}})
keys = sorted({k for v in res.values() for r in v for k in r})
print(f"{'us/step (median of 3)':24s}" + "".join(f"{n:>13s}" for n in res))
for k in keys:
    print(f"{k:24s}" + "".join(f"{statistics.median(r.get(k, 0) for r in res[n]):13.1f}" for n in res))
