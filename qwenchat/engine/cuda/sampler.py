"""The GPU sampler's parameter block, as both decode paths hand it to the kernels."""

from __future__ import annotations

import numpy as np

SAMPLER_HISTOGRAM_BYTES = 32 * 256 * 8  # sample_token's per-warp radix histograms
# struct SampleParams in cuda_src/sampling.cuh
SAMPLE_PARAMS = np.dtype([
    ("temperature", "<f4"), ("top_p", "<f4"), ("min_p", "<f4"), ("repetition_penalty", "<f4"),
    ("presence_penalty", "<f4"), ("frequency_penalty", "<f4"), ("top_k", "<i4"), ("step", "<i4"),
    ("seed", "<u8"),
])
