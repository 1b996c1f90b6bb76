"""Registers the MLX back end. Imports nothing heavy: mlx and mlx-lm load in ``load``."""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
from collections.abc import Mapping

from butter.backend import CheckpointFacts, SessionLayout
from butter.errors import ModelLoadError
from butter.gguf import read_header
from butter.hookspecs import hookimpl
from butter.kvcodec import KVCodec
from butter.resolve import ResolvedModel
from butter_backend_mlx import settings

# ggml types mx.load reads: F32, F16, Q4_0, Q4_1, Q8_0, BF16.
GGUF_TYPES = frozenset({0, 1, 2, 3, 8, 30})
GGUF_ARCHITECTURES = frozenset({"llama", "qwen35", "qwen35moe"})
GGUF_TOKENIZERS = frozenset({"gpt2"})


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


class MLXBackend:
    """HF / MLX folders through mlx-lm's model classes, and GGUF through ``mx.load``."""

    name = "mlx"
    options = settings.OPTIONS
    limits = settings.LIMITS
    takes_threads = False
    decode_paths = settings.DECODE_PATHS
    kv_windows = True  # a window with kept first tokens in the codec cache (kvcache.py)

    @property
    def priority(self) -> int:
        """The platform default: MLX on Apple Silicon, GGUF (priority 10) elsewhere."""
        return 5 if apple_silicon() else 20

    def session_layout(self, options: Mapping[str, object], parallel: int) -> SessionLayout:
        """Sessions keep their own mlx-lm caches; the engine keeps two spare ones. A
        session's caches copy to host memory and back (``--cache-ram``)."""
        return SessionLayout(prompt_cache=True)

    def unavailable(self) -> str | None:
        missing = [name for name in ("mlx", "mlx_lm", "tokenizers") if not _installed(name)]
        if missing:
            extra = "mlx" if apple_silicon() else "mlx[cpu]"
            return (f"{', '.join(missing)} not installed (pip install 'butter-core[mlx]' "
                    f"installs {extra} and mlx-lm)")
        return None

    def can_load(self, resolved: ResolvedModel) -> bool:
        return resolved.format in ("gguf", "hf") and self.unavailable() is None

    def precheck(self, resolved: ResolvedModel) -> CheckpointFacts:
        if resolved.format == "hf":
            return _check_folder(resolved)
        header = read_header(resolved)
        other = header.tensor_types - GGUF_TYPES
        if other:
            raise ModelLoadError(resolved.model_id, "the MLX back end reads GGUF tensors of "
                                 "types F32, F16, BF16, Q4_0, Q4_1 and Q8_0 only; this file has "
                                 "others (K-quants or i-quants): use --backend gguf")
        if header.architecture not in GGUF_ARCHITECTURES:
            raise ModelLoadError(resolved.model_id, "the MLX back end reads GGUFs of "
                                 f"{', '.join(sorted(GGUF_ARCHITECTURES))} only, not "
                                 f"{header.architecture!r}: use --backend gguf")
        if header.tokenizer_model not in GGUF_TOKENIZERS:
            raise ModelLoadError(resolved.model_id, "the MLX back end reads byte-level BPE "
                                 f"(gpt2) vocabularies from GGUF, not "
                                 f"{header.tokenizer_model!r}")
        return CheckpointFacts(architecture=header.architecture,
                               context_length=header.context_length)

    def kv_storage(self, codec: KVCodec) -> str | None:
        """How the MLX runtime stores ``codec``, or None: served raw."""
        if codec.raw:
            return "float16 mlx-lm caches"
        if codec.family == "affine":
            return (f"mx.quantize keys {codec.key_bits}-bit, values {codec.value_bits}-bit, "
                    f"groups of {codec.group_size}; attention through mx.quantized_matmul")
        if codec.family == "aura":
            rotated = "keys and values" if codec.rotate_values else "keys"
            return (f"Hadamard-rotated {rotated}, mx.quantize keys {codec.key_bits}-bit, "
                    f"values {codec.value_bits}-bit; first {codec.sinks} and newest "
                    f"{codec.recent} tokens float16; one softmax over both")
        return None

    def load(self, resolved: ResolvedModel, *, threads: int | None = None):
        if threads is not None:
            raise ModelLoadError(resolved.model_id, "the MLX back end sets no thread count")
        from butter_backend_mlx.checkpoint import load_folder, load_gguf
        from butter_backend_mlx.model import MLXModel

        if resolved.format == "hf":
            checkpoint = load_folder(resolved.path, resolved.model_id)
        else:
            checkpoint = load_gguf(resolved.path, resolved.model_id)
        kind = "GGUF via mx.load" if resolved.format == "gguf" else "mlx-lm folder"
        return MLXModel(checkpoint, description=f"{checkpoint.config.get('model_type')} "
                        f"({kind})")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken one
        return False


def _check_folder(resolved: ResolvedModel) -> CheckpointFacts:
    try:
        config = json.loads((resolved.path / "config.json").read_text())
    except (OSError, ValueError):
        raise ModelLoadError(resolved.model_id, "its config.json cannot be read") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(resolved.model_id, "its config.json names no model_type")
    if not (resolved.path / "tokenizer.json").is_file():
        raise ModelLoadError(resolved.model_id, "the folder has no tokenizer.json")
    # A multimodal checkpoint (Qwen3.5) keeps the text model's settings under text_config.
    text = config.get("text_config")
    context = config.get("max_position_embeddings",
                         text.get("max_position_embeddings") if isinstance(text, dict) else None)
    return CheckpointFacts(architecture=config["model_type"],
                           context_length=context if isinstance(context, int) else None,
                           no_draft_head=_no_draft_head(resolved, config))


def _no_draft_head(resolved: ResolvedModel, config: dict) -> str | None:
    """Why this folder's MTP head cannot draft (mtp.py), or None when it can: a dense
    Qwen3.5 whose config names MTP layers and whose safetensors hold ``mtp.*``."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if config.get("model_type") not in ("qwen3_5", "qwen3_5_text"):
        return f"the MLX back end runs Qwen3.5's MTP head only, not {config['model_type']}'s"
    if not text.get("mtp_num_hidden_layers"):
        return "its config.json names no MTP layers (mtp_num_hidden_layers)"
    if text.get("num_experts"):
        return "its MTP head is a mixture of experts; the MLX back end runs dense ones only"
    if not any(name.startswith(("mtp.", "model.mtp.")) for name in _tensor_names(resolved.path)):
        return "the checkpoint holds no mtp.* weights (an mlx-lm conversion drops them)"
    return None


def _tensor_names(folder) -> set[str]:
    """Tensor names of a folder's safetensors, from the index or each file's header."""
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text()).get("weight_map", {}))
        names: set[str] = set()
        for file in folder.glob("*.safetensors"):
            with open(file, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                names.update(json.loads(handle.read(size)))
        return names
    except (OSError, ValueError):
        return set()


@hookimpl
def register_backends(register) -> None:
    register(MLXBackend())
