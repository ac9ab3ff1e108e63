"""The two architectures fine-tuning trains, DeepSeek-V3.2 and DeepSeek-V4 (``model_type``
``deepseek_v4`` in config.json): what differs between them, so the loop, checkpoints, export and
FSDP serve both. V3.2 saves in its HF layout, V4 in the official release layout, which
flashdsa's V4 loader and transformers' ``DeepseekV4ForCausalLM`` both read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from flashdsa.models.deepseek_v4 import DeepseekV4ForCausalLM, keeps_fp32
from flashdsa.models.deepseek_v4_config import DeepseekV4Config, model_type
from flashdsa.train.forward import layer_forward, model_forward, training_forward
from flashdsa.train.forward_v4 import layer_forward_v4, model_forward_v4, training_forward_v4


def is_v4(model) -> bool:
    return isinstance(model, DeepseekV4ForCausalLM)


def forwards(model) -> tuple[Callable, Callable, Callable]:
    """``(training_forward, model_forward, layer_forward)`` of the model's architecture."""
    if is_v4(model):
        return training_forward_v4, model_forward_v4, layer_forward_v4
    return training_forward, model_forward, layer_forward


def load_trainable(path: Path, device, mtp: Optional[bool] = None) -> torch.nn.Module:
    """The fp32 model of the checkpoint ``path`` (either architecture; FP8 weights dequantized),
    with its MTP layer when ``mtp`` (None: when the checkpoint has one)."""
    from flashdsa.models.config import DeepseekV32Config
    from flashdsa.models.deepseek_v4_loader import load_v4_model
    from flashdsa.models.loader import load_model

    v4 = model_type(path) == "deepseek_v4"
    if mtp is None:
        config = (DeepseekV4Config if v4 else DeepseekV32Config).from_json(path)
        mtp = config.num_nextn_predict_layers > 0
    if v4:
        return load_v4_model(path, device, torch.float32, mtp=mtp)
    return load_model(path, device=device, mode="reference", mtp=mtp, keep_fp8=False)


def add_mtp_layer(model) -> torch.nn.Module:
    """Give ``model`` a fresh (uninitialised) multi-token-prediction layer on its device; returns it."""
    from flashdsa.models import mtp
    from flashdsa.models.deepseek_v4 import MTPLayer

    if not is_v4(model):
        return mtp.add_mtp_layer(model)
    with torch.device(model.device):
        layer = MTPLayer(model.config)
    model.mtp.append(layer)
    model.config.num_nextn_predict_layers = 1
    return layer


def mtp_layer(model) -> torch.nn.Module:
    """The model's (first) multi-token-prediction layer: the one the training loop trains."""
    return model.mtp[0] if is_v4(model) else model.model.mtp


def export(model, weights: dict[str, torch.Tensor], dtype: Optional[torch.dtype]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors under the checkpoint's names) of ``model``'s ``weights`` (its state
    dict, on any device, meta included), cast to ``dtype`` (None: as they are) but the tensors the
    architecture keeps in fp32. A V3.2 MTP layer comes out as the official checkpoint stores it
    (``model.layers.{num_hidden_layers}.*`` plus the embedding and head copies); a V4 model in the
    official V4 layout (``mtp.0.*``, per-expert ``w1`` / ``w2`` / ``w3``)."""
    from flashdsa.models.deepseek_v32 import FP32_PARAMS
    from flashdsa.models.mtp import checkpoint_tensors

    if is_v4(model):
        return export_v4(model, weights, dtype)
    config = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"],
              **model.config.to_dict(), "num_nextn_predict_layers": int(model.has_mtp)}
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = {name: t.detach().to(None if dtype is None or name.endswith(FP32_PARAMS) else dtype)
               for name, t in checkpoint_tensors(model, weights).items()}
    return config, tensors


def export_v4(model: DeepseekV4ForCausalLM, weights: dict[str, torch.Tensor],
              dtype: Optional[torch.dtype]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors under the official names) of a V4 model's ``weights`` (its state
    dict, on any device), floats cast to ``dtype`` but the parts V4 keeps in fp32; no quantization left."""
    from flashdsa.models.deepseek_v4_loader import official_tensors

    config = {**model.config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"],
              "num_nextn_predict_layers": len(model.mtp)}
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = {}
    for name, tensor in weights.items():
        cast = dtype is not None and tensor.is_floating_point() and not keeps_fp32(name)
        tensors[name] = tensor.detach().to(dtype if cast else None)
    return config, official_tensors(model.config, tensors)


def skeleton(model) -> torch.nn.Module:
    """A weightless (meta) copy of ``model`` (with its MTP layer), for applying its state-dict hooks
    to gathered tensors."""
    from flashdsa.models import mtp
    from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM

    with torch.device("meta"):
        if is_v4(model):
            return DeepseekV4ForCausalLM(model.config, torch.float32, len(model.mtp))
        weightless = DeepseekV32ForCausalLM(model.config, model.mode, model.quantization)
    if model.has_mtp:
        mtp.add_mtp_layer(weightless)
    return weightless
