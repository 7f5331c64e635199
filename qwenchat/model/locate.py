"""Turn `--model` (a local directory or a Hugging Face hub id) into a directory on disk."""

from __future__ import annotations

import re
from pathlib import Path

from qwenchat.errors import ModelError, UsageError

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Everything qwenchat reads from a model repository, and nothing else (no .bin or .gguf copies).
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "LICENSE*"]


def looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or "\\" in spec or not HUB_ID.match(spec)


def resolve_model(spec: str) -> Path:
    """A local directory as given, else the hub id's snapshot: from the cache or downloaded."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise UsageError(f"--model {spec}: is a file; pass the model's directory instead")
    if looks_like_path(spec):
        raise UsageError(f"--model {spec}: no such directory (a hub id looks like Qwen/Qwen3-0.6B)")
    return _from_hub(spec)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES))
    except GatedRepoError:
        raise ModelError(f"{repo_id} is gated on the Hugging Face hub: accept its licence "
                         "there and run `hf auth login`, or pass --model DIR") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{repo_id}: no such model on the Hugging Face hub "
                         "(check the id, or pass --model DIR)") from None
    except LocalEntryNotFoundError:
        raise ModelError(_offline_message(repo_id)) from None
    except OSError as exc:
        raise ModelError(f"{_offline_message(repo_id)} [{type(exc).__name__}]") from None
    except Exception as exc:  # the hub client raises many HTTP error types; all mean the same
        if "connect" in str(exc).lower() or "offline" in str(exc).lower():
            raise ModelError(_offline_message(repo_id)) from None
        raise ModelError(f"{repo_id}: download failed ({exc})") from None


def _offline_message(repo_id: str) -> str:
    return (f"{repo_id} is not in the Hugging Face cache and cannot be downloaded now: "
            "connect to the network (and unset HF_HUB_OFFLINE) to fetch it once, "
            "or pass --model DIR with a local copy")
