"""Turn `--model` (a local directory or a Hugging Face hub id) into a directory on disk."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwenchat.errors import ModelError, UsageError

# Called, from the download's threads, with a line on how far a download has got:
# "412 MB of 1.50 GB · 38.2 MB/s · 2 of 5 files".
DownloadProgress = Callable[[str], None]

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Everything qwenchat reads from a model repository, and nothing else (no .bin or .gguf copies).
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "LICENSE*"]


def looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or "\\" in spec or not HUB_ID.match(spec)


def resolve_model(spec: str, progress: DownloadProgress | None = None,
                  flag: str = "--model") -> Path:
    """A local directory as given, else the hub id's snapshot: from the cache or downloaded.

    Without `progress`, a download shows huggingface_hub's own progress bars on stderr. `flag`
    is the option the user gave `spec` with (--model, --draft), as the errors name it.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise UsageError(f"{flag} {spec}: is a file; pass the model's directory instead")
    if looks_like_path(spec):
        raise UsageError(f"{flag} {spec}: no such directory (a hub id looks like Qwen/Qwen3-0.6B)")
    return _from_hub(spec, progress, flag)


def _from_hub(repo_id: str, progress: DownloadProgress | None = None,
              flag: str = "--model") -> Path:
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
    bars = {"tqdm_class": download_bars(progress)} if progress is not None else {}
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES, **bars))
    except GatedRepoError:
        raise ModelError(f"{repo_id} is gated on the Hugging Face hub: accept its licence "
                         f"there and run `hf auth login`, or pass {flag} DIR") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{repo_id}: no such model on the Hugging Face hub "
                         f"(check the id, or pass {flag} DIR)") from None
    except LocalEntryNotFoundError:
        raise ModelError(_offline_message(repo_id, flag)) from None
    except OSError as exc:
        raise ModelError(f"{_offline_message(repo_id, flag)} [{type(exc).__name__}]") from None
    except Exception as exc:  # the hub client raises many HTTP error types; all mean the same
        if "connect" in str(exc).lower() or "offline" in str(exc).lower():
            raise ModelError(_offline_message(repo_id, flag)) from None
        raise ModelError(f"{repo_id}: download failed ({exc})") from None


def _offline_message(repo_id: str, flag: str = "--model") -> str:
    fetch = "connect to the network"
    if switch := _offline_switch():
        fetch = f"unset {switch} and {fetch}"
    return (f"{repo_id} is not in the Hugging Face cache and cannot be downloaded now: "
            f"{fetch} to fetch it once, or pass {flag} DIR with a local copy")


def _offline_switch() -> str | None:
    """The environment variable that keeps huggingface_hub offline, where one is set (read
    as huggingface_hub.constants reads it)."""
    name = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    return name if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") else None


def download_bars(report: DownloadProgress,
                  clock: Callable[[], float] = time.monotonic) -> type:
    """A tqdm class for snapshot_download that draws nothing and reports the download as
    one line instead: the chat's loading screen shows it, where huggingface_hub's own bars
    would go to a stderr that the screen hides.

    Recent huggingface_hub versions open their byte counters with this class too; older
    ones only the count of files.
    """
    from tqdm import tqdm

    tally = _DownloadTally(report, clock)

    class ReportedBar(tqdm):  # type: ignore[misc]
        monitor_interval = 0  # no monitor thread: nothing is drawn

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = _Nowhere()
            kwargs["disable"] = False
            super().__init__(*args, **kwargs)
            tally.changed(self)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            tally.changed(self)
            return shown

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            return True

    return ReportedBar


class _Nowhere:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _size(count: float) -> str:
    """Bytes as huggingface_hub counts them (powers of 1000): "412 MB", "1.50 GB"."""
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            break
        count /= 1000
    if unit == "B" or count >= 100:
        return f"{count:,.0f} {unit}"
    return f"{count:.2f} {unit}" if count < 10 else f"{count:.1f} {unit}"


class _DownloadTally:
    """The bars of one download, summed into one line: bytes (of the total, once known),
    speed, and files. Bars are counted in bytes (unit "B") or in files."""

    RATE_AFTER_S = 1.0  # a speed is shown once it has been measured this long

    def __init__(self, report: DownloadProgress, clock: Callable[[], float] = time.monotonic):
        self._report = report
        self._clock = clock
        self._lock = threading.Lock()
        self._bars: list[Any] = []
        self._first_bytes: tuple[float, float] | None = None  # (time, bytes) when they began

    def changed(self, bar: Any) -> None:
        with self._lock:
            if not any(b is bar for b in self._bars):
                self._bars.append(bar)
            text = self._line()
        if text:
            self._report(text)

    def _line(self) -> str:
        parts = []
        byte_bars = [b for b in self._bars if getattr(b, "unit", "") == "B"]
        if byte_bars:
            done = max(b.n for b in byte_bars)
            totals = [b.total for b in byte_bars if b.total]
            total = min(totals) if totals else None
            parts.append(f"{_size(min(done, total))} of {_size(total)}" if total
                         else _size(done))
            now = self._clock()
            if done and self._first_bytes is None:
                self._first_bytes = (now, done)
            if self._first_bytes is not None:
                started, initial = self._first_bytes
                if now - started >= self.RATE_AFTER_S:
                    parts.append(f"{_size((done - initial) / (now - started))}/s")
        file_bars = [b for b in self._bars if getattr(b, "unit", "") != "B" and b.total]
        if file_bars:
            files = file_bars[-1]
            parts.append(f"{files.n:,} of {files.total:,} files")
        return " · ".join(parts)
