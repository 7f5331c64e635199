"""Slash commands typed in the prompt: what each means, and parsing them into a Command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qwenchat.errors import UsageError
from qwenchat.sampling.params import RANGES, parse_value


@dataclass(frozen=True)
class Command:
    name: str  # canonical, without the slash
    param: str | None = None  # /set and /reset: the parameter; /export: the format
    value: Any = None  # /set: the parsed, validated value
    text: str = ""  # /system, /rename: the text; /export: the file


@dataclass(frozen=True)
class CommandHelp:
    usage: str
    summary: str


HELP: dict[str, CommandHelp] = {
    "help": CommandHelp("/help", "commands and keys"),
    "set": CommandHelp("/set NAME VALUE", "set a sampler value, live (VALUE `default`: back "
                       "to the mode's recommended value); `/set thinking on|off`"),
    "show": CommandHelp("/show", "the sampler values in force"),
    "info": CommandHelp("/info", "the model and the draft: engine, device, GPU memory"),
    "reset": CommandHelp("/reset", "every sampler value back to the mode's recommended one"),
    "think": CommandHelp("/think", "thinking on for this chat, with its recommended values"),
    "no_think": CommandHelp("/no_think", "thinking off, with its recommended values"),
    "system": CommandHelp("/system [TEXT]", "set the system prompt (no text: clear it)"),
    "regen": CommandHelp("/regen", "answer the last message again"),
    "edit": CommandHelp("/edit", "put the last message back in the prompt to edit and resend"),
    "copy": CommandHelp("/copy [code]", "copy the last reply, or its last code block"),
    "clear": CommandHelp("/clear", "delete this chat's messages"),
    "new": CommandHelp("/new", "start a new chat"),
    "chats": CommandHelp("/chats", "list chats: switch, rename, delete"),
    "rename": CommandHelp("/rename TITLE", "rename this chat"),
    "export": CommandHelp("/export md|json [FILE]", "write this chat to a file"),
    "quit": CommandHelp("/quit", "leave qwenchat (Ctrl+Q)"),
}

ALIASES = {"?": "help", "no-think": "no_think", "nothink": "no_think", "regenerate": "regen",
           "retry": "regen", "exit": "quit", "q": "quit", "markdown": "md"}
EXPORT_FORMATS = ("md", "json")
SWITCH_WORDS = {"on": True, "yes": True, "true": True, "1": True,
                "off": False, "no": False, "false": False, "0": False}


def interpret(typed: str) -> Command | str:
    """A Command for `/name ...`; otherwise the message to send (`//x` sends `/x`)."""
    stripped = typed.strip()
    if not stripped.startswith("/"):
        return typed
    if stripped.startswith("//"):
        return typed.replace("/", "", 1)
    head, rest = [*stripped[1:].split(maxsplit=1), "", ""][:2]
    name = ALIASES.get(head.lower(), head.lower())
    if name not in HELP:
        raise UsageError(f"unknown command /{head}: /help lists them (start a message with "
                         "// to send it with a leading /)")
    return _PARSERS.get(name, _no_argument)(name, rest)


def _no_argument(name: str, rest: str) -> Command:
    if rest:
        raise UsageError(f"/{name} takes nothing after it; usage: {HELP[name].usage}")
    return Command(name)


def _set(name: str, rest: str) -> Command:
    words = rest.split()
    if len(words) != 2:
        raise UsageError(f"usage: {HELP['set'].usage}; names: {', '.join(parameter_names())}")
    param, text = words[0].lower().replace("-", "_"), words[1]
    if param in ("thinking", "think"):
        if text.lower() not in SWITCH_WORDS:
            raise UsageError(f"thinking must be on or off; got {text!r}")
        return Command("think" if SWITCH_WORDS[text.lower()] else "no_think")
    if param in RANGES and text.lower() == "default":
        return Command("reset", param)
    return Command("set", param, parse_value(param, text))


def _reset(name: str, rest: str) -> Command:
    if not rest:
        return Command("reset")
    param = rest.lower().replace("-", "_")
    if param not in RANGES:
        raise UsageError(f"unknown sampling parameter {rest!r}; known: "
                         f"{', '.join(parameter_names())}")
    return Command("reset", param)


def _system(name: str, rest: str) -> Command:
    return Command("system", text=rest)


def _rename(name: str, rest: str) -> Command:
    if not rest:
        raise UsageError(f"usage: {HELP['rename'].usage}")
    return Command("rename", text=" ".join(rest.split()))


def _copy(name: str, rest: str) -> Command:
    if rest not in ("", "code"):
        raise UsageError(f"usage: {HELP['copy'].usage}")
    return Command("copy", rest or None)


def _export(name: str, rest: str) -> Command:
    kind, _, path = rest.partition(" ")
    kind = ALIASES.get(kind.lower(), kind.lower())
    if kind not in EXPORT_FORMATS:
        raise UsageError(f"usage: {HELP['export'].usage}")
    return Command("export", kind, text=path.strip())


_PARSERS = {"set": _set, "reset": _reset, "system": _system, "rename": _rename,
            "copy": _copy, "export": _export}


def parameter_names() -> list[str]:
    return [name.replace("_", "-") for name in RANGES]
