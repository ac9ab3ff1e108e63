"""Checkpoints in the Hugging Face layout, plus the training state that makes a resume exact.

A model directory holds ``config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json``) under the checkpoint's own tensor names, and the tokenizer
files; ``flashdsa.models.loader.load_model``, ``generate``, ``serve`` and ``transformers`` read
it. A training checkpoint ``<output>/checkpoints/step-NNNNNN/`` is such a directory with fp32
weights and ``trainer_state.pt`` (optimizer, scheduler, data position, RNG, step).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from flashdsa.models.deepseek_v32 import FP32_PARAMS
from flashdsa.models.mtp import checkpoint_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "generation_config.json")
TRAINER_STATE = "trainer_state.pt"
CHECKPOINTS = "checkpoints"


def save_model(
    model,
    output_dir: str | Path,
    tokenizer_dir: Optional[str | Path] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 4 << 30,
    weights: Optional[dict[str, torch.Tensor]] = None,
) -> Path:
    """Write ``model``'s config, weights (``weights`` when given, e.g. gathered from FSDP shards,
    else its state dict; cast to ``dtype`` when given, fp32-only tensors stay fp32) and the
    tokenizer files found in ``tokenizer_dir`` to ``output_dir``. An MTP layer is written as the
    official checkpoint stores it (``model.layers.{num_hidden_layers}.*``)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], **model.config.to_dict(),
              "num_nextn_predict_layers": int(model.has_mtp)}
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {}
    for name, tensor in checkpoint_tensors(model, model.state_dict() if weights is None else weights).items():
        keep = dtype is None or name.endswith(FP32_PARAMS)
        tensors[name] = tensor.detach().to("cpu", None if keep else dtype).contiguous()
    _save_sharded(tensors, output_dir, max_shard_bytes)
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != output_dir.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, output_dir / name)
    return output_dir


def _save_sharded(tensors: dict[str, torch.Tensor], output_dir: Path, max_shard_bytes: int) -> None:
    """One ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index past ``max_shard_bytes``."""
    for stale in list(output_dir.glob("model*.safetensors")) + list(output_dir.glob("model.safetensors.index.json")):
        stale.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(output_dir / "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(output_dir / file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (output_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step-{step:06d}"


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The newest complete training checkpoint under ``output_dir``, or None."""
    done = sorted(p.parent for p in (Path(output_dir) / CHECKPOINTS).glob(f"step-*/{TRAINER_STATE}"))
    return done[-1] if done else None


def save_training_checkpoint(
    model, state: dict, output_dir: str | Path, step: int, tokenizer_dir, keep: int = 2, weights=None
) -> Path:
    """Save model (training dtype; ``weights`` as in ``save_model``) + ``state`` as checkpoint
    ``step``; keep the newest ``keep``."""
    path = checkpoint_dir(output_dir, step)
    save_model(model, path, tokenizer_dir, weights=weights)
    torch.save(state, path / TRAINER_STATE)  # written last: its presence marks the checkpoint complete
    for old in sorted((Path(output_dir) / CHECKPOINTS).glob("step-*"))[:-keep]:
        shutil.rmtree(old)
    return path


def load_training_state(path: str | Path) -> dict:
    return torch.load(Path(path) / TRAINER_STATE, weights_only=False)
