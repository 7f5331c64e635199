"""Engines that run the model, and the choice between them (`--backend`)."""

from __future__ import annotations

from collections.abc import Callable

from qwenchat.engine.base import Engine, GenerateRequest, Generation, StopReason
from qwenchat.errors import BackendUnavailable, UsageError
from qwenchat.model.loader import Model

BACKENDS = ("auto", "cuda", "cpu")

__all__ = ["BACKENDS", "Engine", "GenerateRequest", "Generation", "StopReason", "create_engine"]


def create_engine(
    backend: str,
    model: Model,
    ctx: int | None = None,
    notice: Callable[[str], None] = lambda _: None,
) -> Engine:
    """The engine for `backend`; `auto` falls back to the CPU and says why through `notice`."""
    if backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if ctx is not None and ctx < 2:
        raise UsageError(f"--ctx must be at least 2 tokens; got {ctx}")
    if backend in ("auto", "cuda"):
        try:
            return _cuda_engine(model, ctx)
        except BackendUnavailable as why:
            if backend == "cuda":
                raise BackendUnavailable(f"--backend cuda: {why}; use --backend cpu") from None
            notice(f"using the CPU reference engine: {why}")
    from qwenchat.engine.reference import ReferenceEngine

    return ReferenceEngine(model.config, model.checkpoint, ctx)


def _cuda_engine(model: Model, ctx: int | None) -> Engine:
    raise BackendUnavailable(
        "the CUDA engine is not available yet in this version of qwenchat"
    )
