"""Checkpoints in the Hugging Face layout, plus the training state that makes a resume exact.

A model directory holds ``config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json``) under the checkpoint's own tensor names, and the tokenizer
files; ``flashdsa.models.loader.load_model``, ``generate``, ``serve`` and ``transformers`` read
it. Each file is written under a temporary name and renamed (``safe_io``). A training checkpoint
``<output>/checkpoints/step-NNNNNN/`` is such a directory with fp32 weights and
``trainer_state.pt`` (optimizer, scheduler, data position, RNG, step), written whole as
``.partial-step-NNNNNN/`` and renamed, so a kill never leaves a half-written ``step-*``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from flashdsa.models.deepseek_v32 import FP32_PARAMS
from flashdsa.models.mtp import checkpoint_tensors
from flashdsa.models.resolve import LOAD_ERRORS
from flashdsa.train.architecture import export_v4, is_v4
from flashdsa.train.safe_io import PARTIAL, atomic_path, write_text

logger = logging.getLogger(__name__)

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
    tokenizer files found in ``tokenizer_dir`` to ``output_dir``. A V3.2 MTP layer is written as the
    official checkpoint stores it (``model.layers.{num_hidden_layers}.*``); a V4 model in the official
    V4 layout (``mtp.0.*``)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    weights = model.state_dict() if weights is None else weights
    if is_v4(model):  # the official release layout
        config, tensors = export_v4(model, weights, dtype)
    else:
        config = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"],
                  **model.config.to_dict(), "num_nextn_predict_layers": int(model.has_mtp)}
        if dtype is not None:
            config["torch_dtype"] = str(dtype).removeprefix("torch.")
        tensors = {}
        for name, tensor in checkpoint_tensors(model, weights).items():
            keep = dtype is None or name.endswith(FP32_PARAMS)
            tensors[name] = tensor.detach().to("cpu", None if keep else dtype).contiguous()
    _save_sharded(tensors, output_dir, max_shard_bytes)
    write_text(output_dir / "config.json", json.dumps(config, indent=2) + "\n")
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != output_dir.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                with atomic_path(output_dir / name) as temporary:
                    shutil.copyfile(Path(tokenizer_dir) / name, temporary)
    return output_dir


def _save_sharded(tensors: dict[str, torch.Tensor], output_dir: Path, max_shard_bytes: int) -> None:
    """One ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index past
    ``max_shard_bytes``; weight files of an earlier save that the new one does not use are removed
    once the new ones are in place."""
    stale = set(output_dir.glob("model*.safetensors")) | set(output_dir.glob("model.safetensors.index.json"))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        with atomic_path(output_dir / name) as temporary:
            save_file(shard, str(temporary), metadata={"format": "pt"})
    written = {output_dir / name for name in names}
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {tensor: name for name, shard in zip(names, shards) for tensor in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text(output_dir / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        written.add(output_dir / "model.safetensors.index.json")
    for path in stale - written:
        path.unlink()


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step-{step:06d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The training checkpoints under ``output_dir``, newest first. Partial ones (a save cut off
    by a kill) are skipped with a warning."""
    root = Path(output_dir) / CHECKPOINTS
    for partial in sorted(root.glob(PARTIAL + "step-*")):
        logger.warning("skipping %s: an incomplete checkpoint (its save was cut off)", partial)
    return sorted((p.parent for p in root.glob(f"step-*/{TRAINER_STATE}")), reverse=True)


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The newest complete training checkpoint under ``output_dir``, or None."""
    done = complete_checkpoints(output_dir)
    return done[0] if done else None


def save_training_checkpoint(
    model, state: dict, output_dir: str | Path, step: int, tokenizer_dir, keep: int = 2, weights=None
) -> Path:
    """Save model (training dtype; ``weights`` as in ``save_model``) + ``state`` as checkpoint
    ``step``; keep the newest ``keep``."""
    path = checkpoint_dir(output_dir, step)
    partial = path.with_name(PARTIAL + path.name)
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    save_model(model, partial, tokenizer_dir, weights=weights)
    torch.save(state, partial / TRAINER_STATE)
    if path.exists():  # the same step saved again (a resumed run stopped where it started)
        shutil.rmtree(path)
    os.replace(partial, path)
    for old in sorted(path.parent.glob("step-*"))[:-keep]:
        shutil.rmtree(old)
    return path


def load_training_state(path: str | Path) -> dict:
    """The trainer state of checkpoint ``path``, its tensors memory-mapped (copy-on-write): a page
    is read when used, so each FSDP rank reads only its rows of the optimizer state."""
    return torch.load(Path(path) / TRAINER_STATE, weights_only=False, mmap=True)


def load_latest_checkpoint(output_dir: str | Path, load: Callable[[Path], torch.nn.Module]
                           ) -> Optional[tuple[Path, torch.nn.Module, dict]]:
    """(path, model, trainer state) of the newest training checkpoint under ``output_dir`` that
    loads, its model read by ``load(path)``; damaged ones (truncated files) are skipped with a
    warning. None if none loads."""
    for path in complete_checkpoints(output_dir):
        try:
            return path, load(path), load_training_state(path)
        except (*LOAD_ERRORS, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            logger.warning("skipping %s: it does not load (%s: %s)", path, type(exc).__name__, exc)
    return None
