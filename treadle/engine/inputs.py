"""What the engine takes from users: the prompt forms every client accepts (torch-free, so
the API process of ``treadle serve`` can name them without loading the engine)."""
from __future__ import annotations

from typing import Any

# a text, its token ids, or a dict with "prompt" and/or "prompt_token_ids"
PromptType = str | list[int] | dict[str, Any]
