"""The model on disk: config, checkpoint, tokenizer and chat template, shared by every engine."""

from qwenchat.model.checkpoint import Checkpoint
from qwenchat.model.config import Qwen3Config
from qwenchat.model.tokenizer import Message, StreamDecoder, Tokenizer

__all__ = ["Checkpoint", "Message", "Qwen3Config", "StreamDecoder", "Tokenizer"]
