"""The chat: conversation, prompt, sampler panel and status bar, and everything they do.

A reply's generation runs in a worker thread that only feeds a ReplyFeed; a UI timer takes
what has arrived every FLUSH_S and renders it as one batch, so the event loop stays free for
typing, scrolling and panel edits at any token rate. The history is written from the UI
thread: the user's message on send, the reply when it starts, every SAVE_S while it streams
(marked stopped until it ends well) and when it ends.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar

from textual import on
from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header, Static

from qwenchat.engine.speculate import SPECULATE_MOST
from qwenchat.errors import QwenchatError, UsageError
from qwenchat.sampling.params import parse_value
from qwenchat.session import Event, ReplyStats
from qwenchat.session import now as session_clock
from qwenchat.store import ChatStore
from qwenchat.tui.chat import Chat
from qwenchat.tui.clipboard import last_code_block, unsupported_reason
from qwenchat.tui.commands import Command, interpret
from qwenchat.tui.feed import ReplyFeed
from qwenchat.tui.loader import ChatModel
from qwenchat.tui.options import ChatOptions
from qwenchat.tui.quiet_gc import FullCollectionsDeferred
from qwenchat.tui.screens.chats import ChatChoice, ChatListScreen
from qwenchat.tui.screens.help import HelpScreen
from qwenchat.tui.settings import ChatSettings
from qwenchat.tui.stats import KV_WARN, RateMeter, stats_from_dict
from qwenchat.tui.widgets.conversation import Conversation
from qwenchat.tui.widgets.message import AssistantMessage
from qwenchat.tui.widgets.prompt import PromptInput
from qwenchat.tui.widgets.sampler import LABELS, SamplerPanel, shown_value
from qwenchat.tui.widgets.status import StatusBar

FLUSH_S = 0.05  # streamed text reaches the screen this often, whatever the token rate
SAVE_S = 0.5  # a streaming reply is saved this often
SHUTDOWN_WAIT_S = 3.0  # on quit, how long a stopping generation may take to return
PREPARE_POLL_S = 0.1  # how often the KV gauge looks whether the background prefill is done

PROMPT_KEYS = [
    ("Enter", "send the message"),
    ("Ctrl+J, Alt+Enter, Shift+Enter", "new line in the message (Shift+Enter where the "
                                       "terminal reports it)"),
    ("Up, in an empty prompt", "edit and resend the last message"),
    ("Tab, Shift+Tab", "move between the prompt, the conversation (arrows and Page Up/Down "
                       "scroll it) and the sampler panel"),
]

# The command palette (Ctrl+P): every action, with what it does.
PALETTE = [
    ("Stop the reply", "Keep what was written, marked stopped (Esc)", "stop"),
    ("Regenerate the last reply", "Answer the last message again (Ctrl+R)", "regenerate"),
    ("Edit the last message", "Put it back in the prompt to change and resend it", "edit_last"),
    ("Copy the last reply", "To the clipboard (F3)", "copy_reply"),
    ("Copy the last code block", "Of the last reply, to the clipboard (F4)", "copy_code"),
    ("Sampler panel", "Show or hide the sampler controls (Ctrl+S)", "toggle_sampler"),
    ("Thinking on/off", "Switch mode, with its recommended values (Ctrl+T)", "toggle_thinking"),
    ("Reset sampler values", "Back to the mode's recommended values", "reset_sampler"),
    ("Show sampler values", "List the values in force in the chat", "show_sampler"),
    ("Model info", "The model and the draft: engine, device, GPU memory", "show_info"),
    ("Set the system prompt", "Type it after /system", "prefill('/system ')"),
    ("New chat", "Start an empty chat (Ctrl+N)", "new_chat"),
    ("Chats", "Switch, rename or delete chats (Ctrl+O)", "chat_list"),
    ("Rename this chat", "Type the title after /rename", "prefill('/rename ')"),
    ("Clear this chat", "Delete its messages", "clear_chat"),
    ("Export to Markdown", "Write this chat to a .md file in the current directory",
     "export('md')"),
    ("Export to JSON", "Write this chat to a .json file in the current directory",
     "export('json')"),
    ("Help", "Keys and slash commands (F1)", "help"),
]


@dataclass
class ActiveReply:
    view: AssistantMessage
    feed: ReplyFeed
    cancel: threading.Event
    saved_at: float
    meter: RateMeter = field(default_factory=RateMeter)
    stats: ReplyStats | None = None


class ChatScreen(Screen[None]):
    AUTO_FOCUS = "#prompt"
    # From this height the sampler panel spaces its rows out (qwenchat.tcss).
    VERTICAL_BREAKPOINTS: ClassVar[list[tuple[int, str]] | None] = [(0, "-short"),
                                                                    (36, "-tall")]
    # The tooltips are what /help says about each key.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", id="stop",
                tooltip="stop the reply; cancel an edit; leave the sampler panel"),
        Binding("escape", "leave", show=False, id="leave"),
        Binding("ctrl+c", "interrupt", show=False, priority=True, id="interrupt",
                tooltip="stop the reply (when none streams: copy the selection)"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate",
                tooltip="answer the last message again"),
        Binding("ctrl+s,f2", "toggle_sampler", "Sampler", id="sampler",
                tooltip="show or hide the sampler panel"),
        Binding("ctrl+t", "toggle_thinking", "Think", id="thinking",
                tooltip="thinking on or off, with the mode's recommended values"),
        # (out of the footer, so that F1 fits it at 80 columns while a reply streams)
        Binding("ctrl+n", "new_chat", "New", show=False, id="new_chat",
                tooltip="start a new chat"),
        Binding("ctrl+o", "chat_list", "Chats", id="chats",
                tooltip="chat list: open, rename, delete"),
        Binding("f3", "copy_reply", "Copy reply", show=False, id="copy_reply",
                tooltip="copy the last reply"),
        Binding("f4", "copy_code", "Copy code block", show=False, id="copy_code",
                tooltip="copy the last reply's last code block"),
        Binding("f1", "help", "Help", id="help", tooltip="this help"),
    ]

    def __init__(self, store: ChatStore, model: ChatModel, options: ChatOptions,
                 clock: Callable[[], float]):
        super().__init__()
        self.store = store
        self.model = model
        self.clock = clock
        settings = ChatSettings(model.directory, options.think, dict(options.overrides))
        # (an engine that cannot verify proposals answers without: on_mount says so)
        self.speculate, self._speculation_note = model.speculation(options.speculate,
                                                                   options.draft)
        self.chat = Chat(store, model, settings, options.system, warn=self._warn,
                         speculate=self.speculate)
        self.debug = options.debug
        self._reply: ActiveReply | None = None
        self._finishing = False  # a reply's last text is still going into its view
        self._drain_timer: Timer | None = None
        self._prepare_timer: Timer | None = None
        self._quiet_gc = FullCollectionsDeferred()
        self._drain_queued = False
        self._editing = False
        self._after_reply: list[Callable[[], Awaitable[None]]] = []
        self._warned_full = False
        self._errored_text = ""  # the prompt's text when the error under it was shown
        # Held, not queried: a late message (a reply ending as the app quits) may still
        # reach this screen while its widgets are being removed.
        self.conversation = Conversation(id="conversation")
        self.prompt_error = Static("", id="prompt-error", markup=False)
        self.prompt = PromptInput(id="prompt", placeholder="Message qwenchat · Enter sends · "
                                  "Ctrl+J new line · /help")
        self.sampler = SamplerPanel(id="sampler")
        self.status = StatusBar(model.status_piece(), id="status", rope_note=model.rope_note(),
                                kv_unavailable=model.kv_unavailable)

    # ------------------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Header(icon="⬢")
        with Horizontal(id="body"):
            with Vertical(id="main"):
                yield self.conversation
                yield self.prompt_error
                yield self.prompt
            yield self.sampler
        yield self.status
        yield Footer()

    def on_mount(self) -> None:
        self.sampler.display = False
        self.prompt_error.display = False
        self._show_settings()
        self._show_title()
        self._status_idle(None)
        self.prompt.focus()
        self._prepare_next_turn()
        if self._speculation_note:
            self.notify(self._speculation_note, severity="warning", timeout=10)

    def on_unmount(self) -> None:
        self._quiet_gc.end()
        self.chat.stop_preparing(timeout=0)  # however the app ends, background work stops,
        if self._reply is not None:  # and so does the generation thread
            self._reply.cancel.set()

    @property
    def generating(self) -> bool:
        """A reply streams, or its last text and summary are not shown yet."""
        return self._reply is not None or self._finishing

    @property
    def engine_in_use(self) -> bool:
        """A reply's generation thread, or the background prefill, has not returned yet (it
        may still be in the engine)."""
        return (self._reply is not None and not self._reply.feed.ended) or self.chat.preparing

    def _prepare_next_turn(self) -> None:
        """While no reply streams, prefill the conversation as the next turn will begin; the
        KV gauge follows once that is done."""
        if self.generating:
            return
        self.chat.start_preparing()
        if self._prepare_timer is None:
            self._prepare_timer = self.set_interval(PREPARE_POLL_S, self._check_prepared)

    def _check_prepared(self) -> None:
        if self.chat.preparing:
            return
        if self._prepare_timer is not None:
            self._prepare_timer.stop()
            self._prepare_timer = None
        if not self.generating:
            self.status.gauge(*self.model.kv())

    async def _stop_preparing(self) -> None:
        """Wait (off the event loop) for the background prefill to finish its current step."""
        if self.chat.preparing:
            await asyncio.to_thread(self.chat.stop_preparing)

    def key_help(self) -> list[tuple[str, str]]:
        keys = list(PROMPT_KEYS)
        for binding in self.BINDINGS:
            assert isinstance(binding, Binding)
            if binding.tooltip:
                keys.append((_key_names(binding.key), binding.tooltip))
        return [*keys, ("Ctrl+P", "command palette: every action"), ("Ctrl+Q", "quit")]

    # ------------------------------------------------------------------------------- input
    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        if not event.text.strip():
            return
        try:
            typed = interpret(event.text)
            if isinstance(typed, Command):
                await self._command(typed)
            else:
                await self._send(typed)
        except QwenchatError as exc:
            self.prompt.give_back(event.text)
            self._prompt_error(str(exc))

    @on(PromptInput.Changed)
    def _typing(self) -> None:
        if self.prompt.text != self._errored_text:  # the user is fixing what was wrong
            self.prompt_error.display = False

    @on(PromptInput.EditLast)
    async def _edit_requested(self) -> None:
        await self.action_edit_last()

    async def _send(self, text: str) -> None:
        if self.generating:
            raise UsageError("a reply is streaming: Esc stops it, then send")
        sent_at = session_clock()  # time to first token counts from here
        cancel = threading.Event()
        await self._stop_preparing()
        if self._editing:
            index = self.chat.last_user_index()
            events = self.chat.edit_last(text, cancel, sent_at)
            await self.conversation.drop_turns_from(index)
            self._stop_editing()
        else:
            events = self.chat.send(text, cancel, sent_at)
        self._show_title()
        await self.conversation.add_user(text)
        await self._stream(events, cancel)

    # --------------------------------------------------------------------------- streaming
    async def _stream(self, events: Iterator[Event], cancel: threading.Event) -> None:
        view = await self.conversation.add_reply()
        feed = ReplyFeed()
        self._quiet_gc.begin()
        self._reply = ActiveReply(view, feed, cancel, saved_at=self.clock())
        self.status.starting()
        # A daemon thread, not a thread worker: workers run on asyncio's default executor,
        # which the app's exit joins, so quitting while a step that cannot be cancelled runs
        # (a long prefill on the CPU) would hang after the screen has gone. Quitting waits
        # SHUTDOWN_WAIT_S at most; the engine is then left to the process's exit.
        threading.Thread(target=feed.pump, args=(events,), name="qwenchat-reply",
                         daemon=True).start()
        self._drain_timer = self.set_interval(FLUSH_S, self._tick)
        self.refresh_bindings()

    class Drain(Message):
        """Time to render what the generation produced since the last drain."""

    def _tick(self) -> None:
        # The drain runs as a message, in turn with this screen's other handlers, never
        # inside the timer's own task: finishing a reply stops the timer.
        if not self._drain_queued:
            self._drain_queued = True
            self.post_message(self.Drain())

    async def on_chat_screen_drain(self) -> None:
        self._drain_queued = False
        await self._drain()

    async def _drain(self) -> None:
        """Render what the generation produced since the last tick, as one batch."""
        reply = self._reply
        if reply is None:
            return
        batch = reply.feed.take()
        for piece in batch.pieces:
            await reply.view.add(piece)
        for dropped in batch.dropped:
            turns = self.conversation.turns
            await self.conversation.add_notice(dropped.message, before=turns[-2])
            self.conversation.mark_context(self.chat.session.first_in_context)
        if batch.stats is not None:
            reply.stats = batch.stats
            reply.meter.add(batch.stats)
            self.status.live(batch.stats, reply.meter.rate, reply.cancel.is_set())
        now = self.clock()
        if now - reply.saved_at >= SAVE_S:
            reply.saved_at = now
            self.chat.save_partial(reply.view.answer, reply.view.thinking, reply.stats)
        if batch.done:
            await self._finish(reply, batch.error)

    async def _finish(self, reply: ActiveReply, error: BaseException | None) -> None:
        self._quiet_gc.end()
        if self._drain_timer is not None:
            self._drain_timer.stop()
            self._drain_timer = None
        self._reply = None
        self._finishing = True
        try:
            await self._close_reply(reply, error)
        finally:
            self._finishing = False
        self.refresh_bindings()
        waiting, self._after_reply = self._after_reply, []
        if not waiting:
            self._prepare_next_turn()
        for then in waiting:
            await then()

    async def _close_reply(self, reply: ActiveReply, error: BaseException | None) -> None:
        restored = self.chat.finish_reply()
        if restored is not None:  # the turn never started: its text goes back to the prompt
            await self.conversation.drop_turns_from(len(self.conversation.turns) - 2)
            self.prompt.give_back(restored)
            self._status_idle(None)
        else:
            last = self.chat.session.last_reply
            assert last is not None
            await reply.view.finish(last.stats, last.stopped)
            self._status_idle(last.stats)
        if error is not None:
            message = _error_text(error, self.debug)
            if restored is not None:
                self._prompt_error(message)
            else:
                await self.conversation.add_notice(message, "error")

    async def _when_idle(self, then: Callable[[], Awaitable[None]]) -> bool:
        """True when no reply streams; otherwise stop it and run `then` once it has ended."""
        if not self.generating:
            return True
        self._after_reply.append(then)
        self.action_stop()
        return False

    def save_now(self) -> None:
        """Save a streaming reply as it stands, with whatever it produced but has not yet
        shown: the last thing qwenchat does when it is quitting or crashing."""
        self.chat.stop_preparing(SHUTDOWN_WAIT_S)
        reply = self._reply
        if reply is None:
            return
        reply.cancel.set()
        reply.feed.wait_ended(SHUTDOWN_WAIT_S)  # so that what is saved is all there will be
        batch = reply.feed.take()
        answer = reply.view.answer + "".join(p.text for p in batch.pieces if p.kind == "answer")
        thinking = reply.view.thinking + "".join(
            p.text for p in batch.pieces if p.kind == "thinking")
        self.chat.save_partial(answer, thinking, batch.stats or reply.stats)

    async def shutdown(self) -> None:
        """Stop a streaming reply (or the background prefill) and record the reply as stopped
        before the app exits."""
        await asyncio.to_thread(self.chat.stop_preparing, SHUTDOWN_WAIT_S)
        reply = self._reply
        if reply is None:
            return
        reply.cancel.set()
        if await asyncio.to_thread(reply.feed.wait_ended, SHUTDOWN_WAIT_S):
            await self._drain()
        else:
            self.save_now()

    # ----------------------------------------------------------------------------- actions
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating  # hidden when idle, so Esc falls through to "leave"
        return True

    def action_stop(self) -> None:
        if self._reply is not None:
            self._reply.cancel.set()  # the engine checks it before every token
            if self._reply.stats is not None:
                self.status.live(self._reply.stats, None, stopping=True)

    def action_interrupt(self) -> None:
        if not self.generating:
            raise SkipAction()  # Ctrl+C then copies a selection, as it does everywhere else
        self.action_stop()

    def action_leave(self) -> None:
        if self._editing:
            self._stop_editing()
            self.prompt.clear()
        elif self.focused is not self.prompt:
            self.prompt.focus()
        else:
            raise SkipAction()

    async def action_regenerate(self) -> None:
        if not await self._when_idle(self.action_regenerate):
            return
        cancel = threading.Event()
        await self._stop_preparing()
        try:
            events = self.chat.regenerate(cancel)
        except UsageError as exc:
            self._prompt_error(str(exc))
            return
        await self.conversation.drop_turns_from(len(self.chat.stored))
        await self._stream(events, cancel)

    async def action_edit_last(self) -> None:
        if not await self._when_idle(self.action_edit_last):
            return
        try:
            text = self.chat.last_user_text()
        except UsageError as exc:
            self._prompt_error(str(exc))
            return
        self._editing = True
        self.prompt.load_text(text)
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.border_title = "editing your last message · Enter resends · Esc cancels"
        self.prompt.add_class("-editing")
        self.prompt.focus()

    def _stop_editing(self) -> None:
        self._editing = False
        self.prompt.border_title = None
        self.prompt.remove_class("-editing")

    async def action_clear_chat(self) -> None:
        if not await self._when_idle(self.action_clear_chat):
            return
        await self._stop_preparing()
        self.chat.clear()
        await self.conversation.show([])
        self._status_idle(None)
        self._prepare_next_turn()
        self.notify("chat cleared")

    async def action_new_chat(self) -> None:
        if not await self._when_idle(self.action_new_chat):
            return
        settings = ChatSettings(self.model.directory, self.chat.settings.thinking,
                                dict(self.chat.settings.overrides))
        await self._switch_to(Chat(self.store, self.model, settings, self.chat.system,
                                   warn=self._warn, speculate=self.speculate))

    async def open_chat(self, chat_id: int) -> None:
        if not await self._when_idle(partial(self.open_chat, chat_id)):
            return
        try:
            chat = Chat.open(self.store, self.model, chat_id, warn=self._warn,
                             speculate=self.speculate)
        except QwenchatError as exc:
            self.notify(str(exc), severity="error")
            return
        await self._switch_to(chat)

    async def _switch_to(self, chat: Chat) -> None:
        await self._stop_preparing()  # the chats share the engine
        self.chat = chat
        self._stop_editing()
        self._warned_full = False
        await self.conversation.show(chat.stored)
        self._show_settings()
        self._show_title()
        last = next((m for m in reversed(chat.stored) if m.role == "assistant"), None)
        self._status_idle(stats_from_dict(last.stats) if last and last.stats else None)
        self.prompt.focus()
        self._prepare_next_turn()

    def action_chat_list(self) -> None:
        current = self.chat.record.id if self.chat.record else None
        self.app.push_screen(ChatListScreen(self.store, current), self._chosen)

    async def _chosen(self, choice: ChatChoice | None) -> None:
        if choice is None:
            return
        record = self.chat.record
        if record is not None and record.id in choice.renamed:
            record.title = choice.renamed[record.id]
            self._show_title()
        if choice.open_id is not None and (record is None or choice.open_id != record.id):
            await self.open_chat(choice.open_id)
        elif choice.new or (record is not None and record.id in choice.deleted):
            await self.action_new_chat()

    def action_copy_reply(self) -> None:
        self._copy(code=False)

    def action_copy_code(self) -> None:
        self._copy(code=True)

    def _copy(self, code: bool) -> None:
        replies = [t for t in self.conversation.turns if isinstance(t, AssistantMessage)]
        reply = replies[-1].answer if replies else ""
        text = last_code_block(reply) if code else reply
        if not text:
            self.notify("the last reply has no code block" if code and reply
                        else "no reply to copy yet", severity="warning")
            return
        self.app.copy_to_clipboard(text)
        reason = unsupported_reason()
        if reason:
            self.notify(f"could not copy: {reason}; /export md FILE writes the chat to a file",
                        severity="warning", timeout=8)
        else:
            what = "code block" if code else "reply"
            self.notify(f"copied the last {what} ({len(text):,} characters)")

    def action_toggle_sampler(self) -> None:
        self.sampler.display = not self.sampler.display
        if not self.sampler.display and self.focused is not None \
                and self.sampler in self.focused.ancestors:
            self.prompt.focus()

    def action_toggle_thinking(self) -> None:
        self._set_thinking(not self.chat.settings.thinking)

    def action_reset_sampler(self) -> None:
        self.chat.reset_params()
        self._show_settings()
        self.notify("sampler back to the recommended values")

    async def action_show_sampler(self) -> None:
        await self.conversation.add_notice(self._settings_line(), "info")

    async def action_show_info(self) -> None:
        await self.conversation.add_notice(self.model.describe(), "info")

    def action_prefill(self, text: str) -> None:
        if text.startswith("/system ") and self.chat.system:
            text += self.chat.system
        self.prompt.load_text(text)
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()

    def action_export(self, kind: str) -> None:
        self._export(kind, "")

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.key_help()))

    # ---------------------------------------------------------------------------- commands
    async def _command(self, command: Command) -> None:
        name = command.name
        if name == "set":
            self.chat.set_param(command.param, command.value)
            self._show_settings()
            label = LABELS.get(command.param or "", command.param)
            self.notify(f"{label} = {shown_value(command.value)}{self._sampler_reach()}")
        elif name == "reset":
            self.chat.reset_params(command.param)
            self._show_settings()
            self.notify(f"{LABELS.get(command.param, command.param)} back to the recommended "
                        "value" if command.param else "sampler back to the recommended values")
        elif name in ("think", "no_think"):
            self._set_thinking(name == "think")
        elif name == "show":
            await self.action_show_sampler()
        elif name == "info":
            await self.action_show_info()
        elif name == "system":
            await self._stop_preparing()
            self.chat.set_system(command.text)
            self._prepare_next_turn()
            self.notify("system prompt set: it applies from the next reply" if command.text
                        else "system prompt cleared")
        elif name == "rename":
            self.chat.rename(command.text)
            self._show_title()
        elif name == "export":
            self._export(command.param or "md", command.text)
        elif name == "copy":
            self._copy(code=command.param == "code")
        elif name == "quit":
            await self.app.action_quit()
        else:
            await self.run_action(COMMAND_ACTIONS[name])

    def _set_thinking(self, on: bool) -> None:
        self.chat.set_thinking(on)
        self._prepare_next_turn()
        self._show_settings()
        params = self.chat.settings.params
        self.notify(f"thinking {'on' if on else 'off'}: temperature {params.temperature}, "
                    f"top-p {params.top_p}, top-k {params.top_k}, min-p {params.min_p}")

    def _export(self, kind: str, target: str) -> None:
        try:
            text = self.chat.export(kind)
            record = self.chat.record
            assert record is not None
            if target:
                path = Path(target).expanduser()
                _write_new(path, text)
            else:
                path = _write_fresh(Path.cwd(), _export_name(record.id, record.title, kind), text)
        except QwenchatError as exc:
            self._prompt_error(str(exc))
        except FileExistsError:
            self._prompt_error(f"{target} already exists: give another file name (nothing was "
                               "written)")
        except OSError as exc:
            self._prompt_error(f"could not write the export: {exc}")
        else:
            self.notify(f"exported to {path}")

    # ----------------------------------------------------------------------- sampler panel
    @on(SamplerPanel.Edited)
    def _panel_edited(self, event: SamplerPanel.Edited) -> None:
        try:
            self.chat.set_param(event.name, parse_value(event.name, event.text))
        except UsageError as exc:
            self.sampler.show_error(event.name, str(exc))
            return
        self.sampler.clear_error(event.name)
        self._show_settings()
        if reach := self._sampler_reach():
            self.notify(reach.removeprefix(" "), timeout=6)

    def _sampler_reach(self) -> str:
        """What a sampler change made during a reply that cannot take it says: a request
        sent to a remote server keeps its values."""
        if self._reply is None or self.model.live_sampler:
            return ""
        return " (from the next reply: a remote server's reply under way keeps its values)"

    @on(SamplerPanel.ThinkingSwitched)
    def _panel_thinking(self, event: SamplerPanel.ThinkingSwitched) -> None:
        if event.on != self.chat.settings.thinking:
            self._set_thinking(event.on)

    @on(SamplerPanel.SpeculationSwitched)
    def _panel_speculation(self, event: SamplerPanel.SpeculationSwitched) -> None:
        """Live, as the other controls: a reply streaming now speculates from its next step
        (the reply itself is the same either way)."""
        if event.on and (why := self.model.cannot_verify()):
            self.notify(why, severity="warning", timeout=6)
            self._show_settings()
            return
        self.speculate = SPECULATE_MOST if event.on else 0
        self.chat.session.set_speculate(self.speculate)

    def _show_settings(self) -> None:
        settings = self.chat.settings
        self.sampler.show(settings.params, set(settings.overrides), settings.thinking,
                          self.chat.session.speculate > 0)

    def _settings_line(self) -> str:
        settings = self.chat.settings
        values = [f"{label} {shown_value(getattr(settings.params, name))}"
                  f"{' •' if name in settings.overrides else ''}"
                  for name, label in LABELS.items()]
        mode = (f"thinking {'on' if settings.thinking else 'off'} · speculation "
                f"{'on' if self.chat.session.speculate else 'off'}")
        return f"{mode} · {' · '.join(values)}  (• set by you)"

    # ------------------------------------------------------------------------------ status
    def _status_idle(self, stats: ReplyStats | None) -> None:
        position, capacity = self.model.kv()
        self.status.idle(stats, position, capacity)
        if capacity and position / capacity >= KV_WARN:
            if not self._warned_full:
                self._warned_full = True
                self.notify(f"the context is {position / capacity:.0%} full: the "
                            "oldest turns will be dropped to make room (/new starts afresh)",
                            severity="warning", timeout=8)
        else:
            self._warned_full = False

    def _show_title(self) -> None:
        self.title = "qwenchat"
        self.sub_title = f"{self.chat.title} · {self.model.spec}"

    def _prompt_error(self, message: str) -> None:
        self._errored_text = self.prompt.text
        self.prompt_error.update(message)
        self.prompt_error.display = True

    def _warn(self, message: str) -> None:
        self.notify(message, severity="error", timeout=10)


COMMAND_ACTIONS = {"help": "help", "regen": "regenerate", "edit": "edit_last",
                   "clear": "clear_chat", "new": "new_chat", "chats": "chat_list"}


def _error_text(error: BaseException, debug: bool) -> str:
    if debug:
        return "".join(traceback.format_exception(error)).rstrip()
    if isinstance(error, QwenchatError):
        return str(error)
    return f"{type(error).__name__}: {error} (rerun with --debug for the traceback)"


def _key_names(keys: str) -> str:
    """"ctrl+s,f2" as people write it: "Ctrl+S, F2"."""
    def name(key: str) -> str:
        return "+".join("Esc" if part == "escape" else part.capitalize() if len(part) > 1
                        else part.upper() for part in key.split("+"))

    return ", ".join(name(key) for key in keys.split(","))


def _write_new(path: Path, text: str) -> None:
    """Write `text` to a file that must not exist yet (an export never overwrites)."""
    with path.open("x", encoding="utf-8") as out:
        out.write(text)


def _write_fresh(folder: Path, name: str, text: str) -> Path:
    """Write to `name` in `folder`, or to name-2, name-3, ... when taken; return the path."""
    stem, dot, suffix = name.rpartition(".")
    for n in range(1, 1000):
        path = folder / (name if n == 1 else f"{stem}-{n}{dot}{suffix}")
        try:
            _write_new(path, text)
        except FileExistsError:
            continue
        return path
    raise QwenchatError(f"{folder} already holds 999 exports of this chat: give a file name")


def _export_name(chat_id: int, title: str, kind: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")
    slug = "-".join(part for part in slug.split("-") if part)[:40] or "chat"
    return f"qwenchat-{chat_id}-{slug}.{kind}"
