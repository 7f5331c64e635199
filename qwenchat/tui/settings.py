"""A chat's sampler settings: thinking mode, and the values the user chose over its preset."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenchat.errors import UsageError
from qwenchat.sampling.params import RANGES, SamplingParams, check_value, generation_defaults


@dataclass
class ChatSettings:
    """Switching thinking mode moves to that mode's recommended values, except for the ones
    the user set: those stay in `overrides` and apply in both modes."""

    model_dir: Path | None
    thinking: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    _presets: dict[bool, SamplingParams] = field(default_factory=dict, repr=False)

    @property
    def params(self) -> SamplingParams:
        return self.preset.with_updates(**self.overrides)

    @property
    def preset(self) -> SamplingParams:
        if self.thinking not in self._presets:  # read generation_config.json once per mode
            self._presets[self.thinking] = generation_defaults(self.model_dir, self.thinking)
        return self._presets[self.thinking]

    def set(self, name: str, value: Any) -> None:
        check_value(name, value)
        self.overrides[name] = value

    def reset(self, name: str | None = None) -> None:
        """Back to the preset: one parameter, or all of them."""
        if name is None:
            self.overrides.clear()
        else:
            self.overrides.pop(name, None)

    def as_dict(self) -> dict[str, Any]:
        """What the history stores: the values in force and the mode."""
        return {**self.params.as_dict(), "thinking": self.thinking}

    @classmethod
    def from_dict(cls, model_dir: Path | None, stored: dict[str, Any]) -> ChatSettings:
        """Read stored settings back; values that equal the preset count as not set, and a
        value that no longer validates is dropped rather than stopping the chat from opening."""
        settings = cls(model_dir, thinking=bool(stored.get("thinking", False)))
        preset = settings.preset.as_dict()
        for name, value in stored.items():
            if name in RANGES and value != preset[name]:
                try:
                    settings.set(name, value)
                except UsageError:
                    continue
        return settings
