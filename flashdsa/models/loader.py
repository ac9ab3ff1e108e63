"""Load a Hugging Face DeepSeek-V3.2 checkpoint (config.json + safetensors) into flashdsa.

Single files (``model.safetensors``) and shards (``model.safetensors.index.json``) are read one
file at a time. Tensor names are the checkpoint's own. FP8 e4m3 weights come with a
``<name>_scale_inv`` fp32 tensor holding one scale per 128x128 block; they are dequantized at
load (w = e4m3 * scale). The multi-token-prediction layers stored after the main stack are
skipped.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint directory ``path``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that do not exist: {missing}")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w: [m, n]`` e4m3 with ``scale_inv: [ceil(m/bm), ceil(n/bn)]`` fp32 -> fp32 ``[m, n]``."""
    m, n = w.shape
    bm, bn = block
    expected = (-(-m // bm), -(-n // bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv for a {list(w.shape)} weight must be {list(expected)}, got {list(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return w.float() * scale


def read_tensors(path: str | Path, config: DeepseekV32Config | None = None):
    """Yield ``(name, tensor)`` for every main-model tensor of the checkpoint, FP8 weights
    dequantized to fp32 (their scale may sit in another shard), MTP layers skipped (logged once)."""
    path = Path(path)
    config = config or DeepseekV32Config.from_json(path)
    block = config.weight_block_size or (128, 128)
    files = checkpoint_files(path)
    where = {}  # tensor name -> file holding it
    for file in files:
        with safe_open(file, framework="pt") as f:
            where.update((name, file) for name in f.keys())
    skipped = 0
    for file in tqdm(files, desc="loading shards", unit="file", leave=False):
        with safe_open(file, framework="pt") as f:
            for name in sorted(f.keys()):
                layer = _LAYER.match(name)
                if layer and int(layer.group(1)) >= config.num_hidden_layers:
                    skipped += 1
                    continue
                if name.endswith(SCALE_SUFFIX):
                    if name[: -len(SCALE_SUFFIX)] not in where:
                        raise ValueError(f"{file.name}: {name} has no weight {name[: -len(SCALE_SUFFIX)]}")
                    continue
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn:
                    if name + SCALE_SUFFIX not in where:
                        raise ValueError(f"{file.name}: FP8 tensor {name} has no {name + SCALE_SUFFIX}")
                    with safe_open(where[name + SCALE_SUFFIX], framework="pt") as g:
                        t = dequantize_blocks(t, g.get_tensor(name + SCALE_SUFFIX), block)
                yield name, t
    if skipped:
        logger.info("skipped %d tensors of the multi-token-prediction layer(s) (not used for generation)", skipped)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", mode: str = "production"
) -> DeepseekV32ForCausalLM:
    """Build a :class:`DeepseekV32ForCausalLM` from the checkpoint directory ``path``.

    Raises ValueError naming every missing, unexpected or mis-shaped tensor.
    """
    path = Path(path)
    config = DeepseekV32Config.from_json(path)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, mode)
    expected = dict(model.state_dict())  # name -> meta tensor (parameters and buffers)
    loaded: dict[str, torch.Tensor] = {}
    unexpected, misshaped = [], []
    for name, t in read_tensors(path, config):
        if name not in expected:
            unexpected.append(name)
        elif t.shape != expected[name].shape:
            misshaped.append(f"{name}: expected {list(expected[name].shape)}, got {list(t.shape)}")
        else:
            loaded[name] = t.to(device=device, dtype=model.param_dtype(name))
    missing = sorted(set(expected) - set(loaded) - {m.split(":")[0] for m in misshaped})
    problems = [
        f"{label} ({len(names)}): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
        for label, names in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped))
        if names
    ]
    if problems:
        raise ValueError(f"checkpoint {path} does not match the DeepSeek-V3.2 model: " + "; ".join(problems))
    model.load_state_dict(loaded, assign=True)
    return model.eval()
