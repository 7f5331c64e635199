"""Sampling parameters and the NumPy sampler, shared by every engine."""

from qwenchat.sampling.params import (
    NON_THINKING,
    THINKING,
    LiveParams,
    SamplingParams,
    generation_defaults,
    parse_value,
)

__all__ = [
    "NON_THINKING",
    "THINKING",
    "LiveParams",
    "SamplingParams",
    "generation_defaults",
    "parse_value",
]
