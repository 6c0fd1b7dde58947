"""Tolerances derived from the dtype and the length of the reduction, not from one machine.

Two computations that sum the same `n` terms in different orders differ by at most about
n * eps of the sum of the terms' magnitudes (Higham, Accuracy and Stability of Numerical
Algorithms, section 4.2). Compared element by element, a gradient entry whose terms cancel can
show any relative difference, so the comparison is normwise per tensor: the largest difference
over the largest magnitude of the reference tensor.
"""

from __future__ import annotations

import torch


def reduction_tolerance(dtype: torch.dtype, num_terms: int) -> float:
    """Normwise relative bound for a sum of `num_terms` terms reordered, in `dtype`."""
    return num_terms * torch.finfo(dtype).eps


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are zero)."""
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff
