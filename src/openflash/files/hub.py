"""Models downloaded with the Hugging Face tools: `--model deepseek-ai/DeepSeek-V4.1-Flash` is the snapshot in the
local hub cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), resolved by huggingface_hub
offline. Nothing is downloaded at run time: a model not in the cache is refused with the command that fetches it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from openflash.errors import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(spec: str) -> bool:
    """'org/name' that is not a path here (a relative folder of that name wins)."""
    return bool(_REPO_ID.match(spec)) and not Path(spec).exists() and not spec.endswith((".json", ".safetensors"))


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub reads, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of a hub model; CheckpointError naming the cache and the download command when
    it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise CheckpointError(f"{repo_id}: neither a local folder nor a model in the Hugging Face cache ({cache}); "
                              f"download it once with `hf download {repo_id}` (set HF_HOME to use another cache), "
                              f"or give the checkpoint folder") from None


__all__ = ["looks_like_repo_id", "hub_snapshot", "hub_cache_dir"]
