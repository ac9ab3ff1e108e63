"""From a model argument to a loaded model: the one path that ``generate``, ``serve``, ``check``,
``finetune`` and :class:`flashdsa.runtime.llm.LLM` take.

A model argument is a local checkpoint directory (Hugging Face layout), a Hugging Face Hub repo id
(``org/name``: taken from the local Hugging Face cache as it is, else downloaded when the Hub can be
reached), or None for the embedded default model. Every failure is an
:class:`~flashdsa.errors.ArgumentError` naming ``model``, ``mode`` or ``device`` and saying what to
pass instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError

from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.errors import ArgumentError, blame
from flashdsa.models.caches import MODES
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v4_config import DeepseekV4Config, model_type
from flashdsa.runtime.parallel.shard import ParallelConfig

logger = logging.getLogger(__name__)

# The files a checkpoint needs from its Hub repo (weights, configs, tokenizer, chat template).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
LOAD_ERRORS = (ValueError, OSError, SafetensorError)  # what a damaged checkpoint raises while loading
V4 = "deepseek_v4"
ModelConfig = Union[DeepseekV32Config, DeepseekV4Config]


def default_device() -> torch.device:
    """CUDA when a GPU is visible, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(device: Union[str, torch.device, None]) -> torch.device:
    """``device`` (None: :func:`default_device`) once it is seen to exist on this machine."""
    if device is None:
        return default_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ArgumentError("device", f"expected cpu, cuda or cuda:N, got {device!r}") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise ArgumentError("device", f"flashdsa runs on cpu or cuda, got {device!r}")
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
        raise ArgumentError("device", f"{device!r} asked for, but CUDA is not available ({why}); use cpu")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ArgumentError("device", f"{device!r} does not exist: {torch.cuda.device_count()} GPU(s) visible")
    return parsed


def resolve_model(model: Union[str, Path, None]) -> Path:
    """The checkpoint directory that ``model`` names (not yet checked: see :func:`read_checkpoint`)."""
    if model is None:
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ArgumentError("model", f"{model} is a file; pass the checkpoint directory that holds its config.json")
    if not _is_repo_id(str(model)):
        raise ArgumentError("model", f"{model}: no such directory")
    return _from_hub(str(model))


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") > 1 or name.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _from_hub(repo_id: str) -> Path:
    """The snapshot of ``repo_id`` in the Hugging Face cache: as cached, else downloaded."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    logger.info("%s is not a local directory nor in the Hugging Face cache (%s): downloading it", repo_id,
                constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        raise ArgumentError("model", f"{repo_id} is not a local directory nor in the Hugging Face cache "
                                     f"({constants.HF_HUB_CACHE}), and the Hub cannot be reached to download it; "
                                     f"pass a checkpoint directory, or run `hf download {repo_id}` online") from None
    except GatedRepoError:
        raise ArgumentError("model", f"{repo_id} is gated on the Hugging Face Hub: accept its terms there and "
                                     f"set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ArgumentError("model", f"{repo_id} is not a local directory nor a model on the Hugging Face Hub "
                                     f"(a private one needs HF_TOKEN)") from None
    except OSError as exc:
        raise ArgumentError("model", f"cannot download {repo_id} from the Hugging Face Hub: {exc}") from exc


def read_checkpoint(path: Path) -> ModelConfig:
    """The config of the checkpoint directory ``path`` once it is seen to hold a DeepSeek-V3.2 or
    DeepSeek-V4 model (told apart by ``model_type``): a valid config.json, weight files and a tokenizer."""
    from flashdsa.models.loader import checkpoint_files

    if not any(path.iterdir()):
        raise ArgumentError("model", f"{path} is empty; pass a checkpoint directory (config.json, *.safetensors, "
                                     f"tokenizer files)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ArgumentError("model", f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArgumentError("model", f"{config_file} is not valid JSON ({exc}): damaged or truncated") from None
    with blame("model", (ValueError, TypeError)):
        if not isinstance(raw, dict):
            raise ValueError(f"{config_file} must hold a JSON object, got {type(raw).__name__}")
        config = (DeepseekV4Config if raw.get("model_type") == V4 else DeepseekV32Config).from_dict(raw)
        checkpoint_files(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ArgumentError("model", f"{path} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return config


def is_v4(config: ModelConfig) -> bool:
    return isinstance(config, DeepseekV4Config)


def check_mode(config: ModelConfig, mode: str, quantization: Optional[str] = None) -> None:
    """ArgumentError naming ``mode`` (or ``quantization``) unless the model can run that way (the
    model's own rule, checked on the meta device: nothing is allocated)."""
    from flashdsa.models.deepseek_v4 import DeepseekV4ForCausalLM
    from flashdsa.models.deepseek_v32 import QUANTIZATIONS, DeepseekV32ForCausalLM

    if mode not in MODES:
        raise ArgumentError("mode", f"expected one of {', '.join(MODES)}, got {mode!r}")
    if quantization not in QUANTIZATIONS:
        raise ArgumentError("quantization", f"expected one of {QUANTIZATIONS}, got {quantization!r}")
    v4 = is_v4(config)
    if v4 and quantization is not None:
        raise ArgumentError("quantization", "DeepSeek-V4 checkpoints run with their FP8 weights dequantized at "
                                            "load for now: leave quantization unset")
    with blame("mode"), torch.device("meta"):
        DeepseekV4ForCausalLM(config, mode=mode) if v4 else DeepseekV32ForCausalLM(config, mode)


def check_v4_features(parallel: ParallelConfig, mtp: bool) -> None:
    """ArgumentError for what the DeepSeek-V4 engine path does not do yet: several GPUs, speculative decoding."""
    if parallel.tensor_parallel_size > 1 or parallel.enable_expert_parallel:
        raise ArgumentError("tensor_parallel_size", "DeepSeek-V4 runs on one GPU for now: use tensor_parallel_size 1 "
                                                    "without expert parallelism")
    if mtp:
        raise ArgumentError("speculative_tokens", "speculative decoding with DeepSeek-V4's MTP layer is not "
                                                  "supported yet: use speculative_tokens 0")


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer; any failure of the tokenizer libraries is a damaged checkpoint."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # tokenizers raises plain Exceptions on damaged files
        raise ArgumentError("model", f"cannot load the tokenizer of {path}: {exc}") from exc


@contextmanager
def _weight_files_of(path: Path) -> Iterator[None]:
    """A damaged safetensors file read in the block is an ArgumentError naming ``model``."""
    try:
        yield
    except SafetensorError as exc:
        raise ArgumentError("model", f"{path} holds a damaged or truncated weight file ({exc})") from exc


def load_weights(path: Path, device: torch.device, mode: str, quantization: Optional[str] = None,
                 parallel: Optional[ParallelConfig] = None, mtp: bool = False) -> torch.nn.Module:
    """The model of checkpoint ``path``. With ``parallel`` it goes through the inference launcher
    (rank 0's part when it splits the model over ranks; on CUDA the memory plan is checked first);
    without, it is loaded whole in this process (fine-tuning, whose ranks shard it themselves).
    A split the model or the GPUs cannot take is an ArgumentError naming ``tensor_parallel_size``,
    caught before any weight is read; missing, mis-shaped or damaged tensors name ``model``.
    ``mtp`` also loads the multi-token-prediction layer (speculative decoding)."""
    from flashdsa.models.deepseek_v4_loader import load_v4_model
    from flashdsa.models.loader import load_model
    from flashdsa.runtime.parallel.launcher import check_parallel, load

    if model_type(path) == V4:
        check_v4_features(parallel or ParallelConfig(), mtp and parallel is not None)
        with _weight_files_of(path), blame("model"):
            return load_v4_model(path, device, mtp=mtp, mode=mode)
    if parallel is None:
        with _weight_files_of(path), blame("model"):
            return load_model(path, device, mode, quantization, mtp=mtp)
    with _weight_files_of(path), blame("tensor_parallel_size" if parallel.tensor_parallel_size > 1 else "model"):
        check_parallel(path, parallel, device, mode, quantization)  # reads config.json and weight headers
    with _weight_files_of(path), blame("model"):
        return load(path, parallel, device, mode, quantization, mtp=mtp)


def open_model(
    model: Union[str, Path, None] = None, device: Union[str, torch.device, None] = None, mode: str = "production",
    quantization: Optional[str] = None, parallel: Optional[ParallelConfig] = None, mtp: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) for a model argument (None: the embedded default model) on ``device``
    (None: CUDA when present) in precision ``mode``, served through the inference launcher
    (split over ranks by ``parallel``)."""
    device = parse_device(device)
    parallel = parallel or ParallelConfig()
    path = resolve_model(model)
    check_mode(read_checkpoint(path), mode, quantization)
    tokenizer = load_tokenizer(path)  # before the weights: it fails fast on a damaged checkpoint
    return load_weights(path, device, mode, quantization, parallel, mtp), tokenizer
