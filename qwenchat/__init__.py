"""qwenchat: chat with Qwen3 models in the terminal, on your own GPU or on the CPU."""

__version__ = "0.1.0"
