"""The qwenchat Textual app: opens the history, loads the model while showing progress, then
hands over to the chat screen; `run_chat` is what `qwenchat chat` runs."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from types import EllipsisType
from typing import ClassVar

from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.screen import Screen

from qwenchat.errors import QwenchatError
from qwenchat.store import ChatStore
from qwenchat.tui.keys import read_alt_enter
from qwenchat.tui.loader import ChatModel, Loader, model_loader
from qwenchat.tui.options import ChatOptions
from qwenchat.tui.screens.chat import PALETTE, ChatScreen
from qwenchat.tui.screens.error import ErrorScreen
from qwenchat.tui.screens.loading import LoadingScreen


class QwenchatApp(App[int]):
    CSS_PATH = "qwenchat.tcss"
    TITLE = "qwenchat"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+q", "quit", "Quit", priority=True, show=False, id="quit"),
    ]

    class LoadStep(Message):
        def __init__(self, text: str, notice: bool = False):
            super().__init__()
            self.text = text
            self.notice = notice

    class LoadProgress(Message):
        """The current step's progress has changed: the latest is in `_progress_text`."""

    class Loaded(Message):
        def __init__(self, model: ChatModel):
            super().__init__()
            self.model = model

    class LoadFailed(Message):
        def __init__(self, error: BaseException):
            super().__init__()
            self.error = error

    def __init__(
        self,
        options: ChatOptions,
        loader: Loader | None = None,
        history: Path | EllipsisType | None = ...,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`loader` makes the model (tests pass a fake engine); `history` is the SQLite file,
        None keeps nothing on disk, and ... means the user's data dir (or None with
        --no-history)."""
        super().__init__()
        read_alt_enter()
        self.options = options
        self.clock = clock
        self._loader = loader or model_loader(options)
        if history is ...:
            history = ChatStore.default_path() if options.history else None
        self._history = history
        self.store: ChatStore | None = None
        self.model: ChatModel | None = None  # once loaded; closed on the way out
        self.chat_screen: ChatScreen | None = None
        self._loading: LoadingScreen
        self.error_message: str | None = None  # why the app could not start
        self._notices: list[str] = []
        # A download reports often, from its own threads: only its latest line matters, so
        # at most one LoadProgress message is on its way at a time.
        self._progress_lock = threading.Lock()
        self._progress_text: str | None = None

    def on_mount(self) -> None:
        # Held: the command palette (or help) may be open above it while the model loads.
        self._loading = LoadingScreen(self.options.model, self.clock)
        self.push_screen(self._loading)
        self.store = ChatStore(self._history, notice=self._notices.append)
        for notice in self._notices:
            self.notify(notice, title="chat history", severity="warning", timeout=15)
        self._notices.clear()
        # A daemon thread, not a worker: a download or a kernel build cannot be interrupted,
        # and quitting while one runs must not wait for it.
        threading.Thread(target=self._load, name="qwenchat-load", daemon=True).start()

    def _load(self) -> None:
        """In the loading thread: every step and notice goes to the UI as a message."""
        try:
            model = self._loader(lambda text: self.post_message(self.LoadStep(text)),
                                 lambda text: self.post_message(self.LoadStep(text, True)),
                                 self._progress)
        except BaseException as exc:  # shown on the error screen, never as a traceback
            self.post_message(self.LoadFailed(exc))
        else:
            self.post_message(self.Loaded(model))

    def _progress(self, text: str) -> None:
        with self._progress_lock:
            pending = self._progress_text is not None
            self._progress_text = text
        if not pending:
            self.post_message(self.LoadProgress())

    def on_qwenchat_app_load_progress(self) -> None:
        with self._progress_lock:
            text, self._progress_text = self._progress_text, None
        if text is not None:
            self._loading.progress(text)

    def on_qwenchat_app_load_step(self, message: LoadStep) -> None:
        if message.notice:
            self._notices.append(message.text)  # shown again once the chat is open
        if message.notice:
            self._loading.note(message.text)
        else:
            self._loading.step(message.text)

    async def on_qwenchat_app_loaded(self, message: Loaded) -> None:
        self._loading.finish()
        assert self.store is not None
        self.model = message.model
        self.chat_screen = ChatScreen(self.store, message.model, self.options, self.clock)
        await self._replace_loading(self.chat_screen)
        for notice in self._notices:
            self.notify(notice, severity="warning", timeout=10)
        self._notices.clear()

    async def on_qwenchat_app_load_failed(self, message: LoadFailed) -> None:
        error = message.error
        if isinstance(error, QwenchatError):
            self.error_message = str(error)
        else:
            self.error_message = (f"{type(error).__name__}: {error} (rerun with --debug for "
                                  "the traceback)")
        details = "".join(traceback.format_exception(error)) if self.options.debug else None
        await self._replace_loading(ErrorScreen(self.error_message, details))

    async def _replace_loading(self, screen: Screen) -> None:
        """Put `screen` where the loading screen is, closing anything opened above it."""
        while self._loading in self.screen_stack and self.screen is not self._loading:
            await self.pop_screen()
        await self.switch_screen(screen)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        if isinstance(screen, ChatScreen):
            for title, help_text, action in PALETTE:
                yield SystemCommand(title, help_text, _runner(screen, action))
        yield from super().get_system_commands(screen)

    async def action_quit(self) -> None:
        if self.chat_screen is not None:
            await self.chat_screen.shutdown()
        code = 1 if self.error_message else 0
        self.exit(code, return_code=code)

    def close_everything(self) -> None:
        """Save a reply cut short, close the history, then the engine; safe to repeat.

        An engine that a reply's thread is still inside (it did not stop within
        SHUTDOWN_WAIT_S) is left to the process's exit, which frees its memory anyway:
        freeing it under a running step could crash that thread.
        """
        in_use = False
        if self.chat_screen is not None:
            self.chat_screen.save_now()
            in_use = self.chat_screen.engine_in_use
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.model is not None and not in_use:
            model, self.model = self.model, None
            try:
                model.close()
            except Exception:
                # The process is ending, which frees the memory anyway: a failure here must
                # not turn a clean quit into a traceback.
                if self.options.debug:
                    raise


def _runner(screen: ChatScreen, action: str) -> Callable[[], object]:
    async def run() -> None:
        await screen.run_action(action)

    return run


def run_chat(options: ChatOptions) -> int:
    app = QwenchatApp(options)
    try:
        app.run()
    finally:
        app.close_everything()  # also after a crash or an external Ctrl+C
    if app.error_message:
        raise QwenchatError(app.error_message)  # the reason stays on the terminal as one line
    return app.return_code or 0
