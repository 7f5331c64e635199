"""/help and F1: every key and slash command on one screen."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from qwenchat.tui.commands import HELP, parameter_names


def help_markdown(keys: list[tuple[str, str]]) -> str:
    rows = ["## Keys", "", "| key | does |", "|---|---|"]
    rows += [f"| {key} | {what} |" for key, what in keys]
    rows += ["", "## Commands", "", "| command | does |", "|---|---|"]
    rows += [f"| `{entry.usage}` | {entry.summary} |" for entry in HELP.values()]
    rows += ["", f"Sampler names: {', '.join(parameter_names())}. A message that starts "
             "with `//` is sent with one leading `/`.", "", "Esc, q or F1 closes this."]
    return "\n".join(rows)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [("escape,q,f1", "dismiss", "Close")]

    def __init__(self, keys: list[tuple[str, str]]):
        super().__init__()
        self._keys = keys

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Markdown(help_markdown(self._keys))
