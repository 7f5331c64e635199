"""The sampler side panel: every sampling value in force, editable while a reply streams."""

from __future__ import annotations

from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Input, Label, Static, Switch

from qwenchat.sampling.params import RANGES, SamplingParams
from qwenchat.tui.keys import FieldInput

LABELS = {
    "temperature": "temperature",
    "top_p": "top-p",
    "top_k": "top-k",
    "min_p": "min-p",
    "presence_penalty": "presence penalty",
    "frequency_penalty": "frequency penalty",
    "repetition_penalty": "repetition penalty",
    "max_tokens": "max tokens",
    "seed": "seed",
}


def shown_value(value: Any) -> str:
    return "none" if value is None else str(value)


class SamplerPanel(VerticalScroll):
    """Enter (or leaving a field) applies its value; the screen validates it and calls
    `show` with what is in force, or `show_error` beside the field."""

    class Edited(Message):
        def __init__(self, name: str, text: str):
            super().__init__()
            self.name = name
            self.text = text

    class ThinkingSwitched(Message):
        def __init__(self, on: bool):
            super().__init__()
            self.on = on

    class SpeculationSwitched(Message):
        def __init__(self, on: bool):
            super().__init__()
            self.on = on

    def __init__(self, id: str | None = None):
        super().__init__(id=id)
        # Held, not queried: values can be shown before the fields are mounted, or while the
        # screen is being torn down.
        self._switch = Switch(id="thinking", animate=False)
        self._speculation = Switch(id="speculation", animate=False,
                                   tooltip="speculative decoding: propose tokens and verify "
                                   "several a step; the reply is the same")
        self._labels = {name: Label(label, id=f"label-{name}", classes="param-label")
                        for name, label in LABELS.items()}
        self._fields = {name: FieldInput(id=f"param-{name}", tooltip=f"{label}: {RANGES[name][4]}",
                                    select_on_focus=True, compact=True)
                        for name, label in LABELS.items()}
        self._errors = {name: Static("", id=f"error-{name}", classes="param-error",
                                     markup=False) for name in LABELS}
        self._shown: dict[str, str] = {}  # what each field showed as in force

    def compose(self) -> ComposeResult:
        yield Static("Sampler", classes="panel-title")
        with Horizontal(classes="row"):
            yield Label("thinking", classes="param-label")
            yield self._switch
        with Horizontal(classes="row"):
            yield Label("speculation", classes="param-label")
            yield self._speculation
        for name in LABELS:
            with Horizontal(classes="row"):
                yield self._labels[name]
                yield self._fields[name]
            yield self._errors[name]
        yield Static("• set by you; the others are the mode's recommended values "
                     "(/reset goes back to them). Enter applies a value, live.",
                     classes="panel-hint", markup=False)

    def show(self, params: SamplingParams, user_set: set[str], thinking: bool,
             speculating: bool = False) -> None:
        """Display the values in force (a field being typed in keeps its text)."""
        # Shown, not switched: a Changed message from here, arriving after the user's own
        # switch, would switch back, and the two would flip each other for ever.
        with self._switch.prevent(Switch.Changed):
            self._switch.value = thinking
        with self._speculation.prevent(Switch.Changed):
            self._speculation.value = speculating
        for name, label in LABELS.items():
            self._labels[name].update(f"{label}{' •' if name in user_set else ''}")
            shown = shown_value(getattr(params, name))
            if shown != self._shown.get(name):  # a new value in force (/set, a mode switch):
                self.clear_error(name)  # an error about an earlier attempt no longer applies
            self._shown[name] = shown
            if not self._fields[name].has_focus:
                self._fields[name].value = self._shown[name]

    def show_error(self, name: str, message: str) -> None:
        self._errors[name].update(message)
        self._errors[name].display = True
        self._fields[name].value = self._shown[name]  # back to the value in force

    def clear_error(self, name: str) -> None:
        self._errors[name].display = False

    @on(Input.Submitted)
    @on(Input.Blurred)
    def _edited(self, event: Input.Submitted | Input.Blurred) -> None:
        event.stop()
        name = (event.input.id or "").removeprefix("param-")
        if name in LABELS and event.value.strip() != self._shown.get(name):
            self.post_message(self.Edited(name, event.value.strip()))

    @on(Switch.Changed, "#thinking")
    def _switched(self, event: Switch.Changed) -> None:
        event.stop()
        self.post_message(self.ThinkingSwitched(event.value))

    @on(Switch.Changed, "#speculation")
    def _speculation_switched(self, event: Switch.Changed) -> None:
        event.stop()
        self.post_message(self.SpeculationSwitched(event.value))
