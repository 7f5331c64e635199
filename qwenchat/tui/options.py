"""What `qwenchat chat` was asked for, checked before any model loads or the screen changes."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenchat.ask import check_overrides
from qwenchat.engine import EngineFlags
from qwenchat.engine.speculate import check_speculate
from qwenchat.errors import UsageError
from qwenchat.model.locate import looks_like_path, resolve_model
from qwenchat.remote import BACKEND, check_remote_flags


@dataclass
class ChatOptions(EngineFlags):
    model: str
    system: str | None = None
    think: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling flags the user gave
    speculate: str = "off"  # "ngram": prompt lookup, verified several tokens a step
    draft: str | None = None  # a draft model that proposes instead
    history: bool = True  # False: --no-history, nothing is written to disk
    debug: bool = False
    url: str | None = None  # --backend openai: the server's address
    api_key_env: str | None = None  # --backend openai: the variable holding its API key


def check_chat_options(options: ChatOptions) -> None:
    """The same checks, and the same one-line errors, as `ask`: before the app starts."""
    check_overrides(options.overrides)
    check_remote_flags(options.backend, options.url, options.api_key_env)
    if options.backend == BACKEND:
        return  # the model is the server's: nothing here to check
    options.check_engine_flags()
    check_speculate(options.speculate, options.draft)
    # A local path that is wrong is a typo to report now; a hub id may need a download,
    # which the loading screen shows.
    for flag, spec in (("--model", options.model), ("--draft", options.draft)):
        if spec and (looks_like_path(spec) or Path(spec).expanduser().exists()):
            resolve_model(spec, flag=flag)


def require_terminal() -> None:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the chat needs a terminal: run qwenchat in one, or use "
                         "`qwenchat ask` in pipes and scripts")
