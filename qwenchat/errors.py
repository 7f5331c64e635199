"""Errors a user can cause or fix: each carries one readable line, shown without a traceback."""


class QwenchatError(Exception):
    """A failure with a message meant for the user; the CLI prints it and exits with `exit_code`."""

    exit_code = 1


class UsageError(QwenchatError):
    """A bad flag, parameter or prompt: the command line must change (exit code 2)."""

    exit_code = 2


class ModelError(QwenchatError):
    """The model directory, its config, weights or tokenizer cannot be used."""


class ContextFullError(QwenchatError):
    """A prompt that cannot fit in the KV cache even after dropping earlier turns."""


class BackendUnavailable(QwenchatError):
    """The requested engine cannot run on this machine (no GPU, driver or NVRTC)."""
