"""Alpha-beta communication time: time = alpha + algorithm_factor * bytes / bandwidth.

Defaults are fitted to the H100 measurements of skrull.txt appendix A.3 (table 3: latency of
2 MB .. 1 GB collectives inside one 8-GPU node). `fit_alpha_beta` turns such a table into
(alpha, effective bandwidth); the effective bandwidth is scaled by the cluster's link bandwidth
relative to the H100 NVLink it was measured on, and by the ring algorithm's factor for other
group sizes: all-gather, reduce-scatter and all-to-all move (n-1)/n of the buffer per rank,
all-reduce twice that.
"""

from __future__ import annotations

import numpy as np

from lengthwise.errors import UserError
from lengthwise.specs import ClusterSpec

# skrull.txt appendix A.3, table 3: message size (MB) -> latency (us), 8 x H100 in one node.
SKRULL_H100_TABLE_US = {
    "all_gather": [53.29, 72.52, 97.86, 199.3, 286.2, 488.6, 910.6, 1758.4, 3416.4, 6467.9],
    "all_to_all": [80.62, 78.63, 110.9, 163.2, 277.5, 502.4, 939.2, 1803.9, 3411.2, 6629.6],
    "reduce_scatter": [59.48, 79.26, 104.7, 177.4, 269.5, 458.8, 864.3, 1663.9, 3239.5, 6294.3],
    "all_reduce": [84.65, 113.3, 168.4, 312.2, 479.2, 859.7, 1642.9, 3197.9, 6181.2, 12126.0],
}
SKRULL_SIZES_MB = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
SKRULL_RANKS = 8
SKRULL_LINK_GBPS = 900.0
INTER_NODE_EFFICIENCY = 0.8
"""Share of InfiniBand line rate a ring collective reaches across nodes. The NVLink efficiency
fitted from skrull's table (~0.17 of 900 GB/s) describes NVLink only; applying it to IB would
make cross-node gradient reduction five times too slow."""
COLLECTIVES = tuple(SKRULL_H100_TABLE_US)


def ring_factor(kind: str, ranks: int) -> float:
    """Fraction of the buffer each rank sends in a ring implementation."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    return 2 * share if kind == "all_reduce" else share


def fit_alpha_beta(sizes_bytes, latencies_s) -> tuple[float, float]:
    """Least-squares (alpha seconds, seconds per byte) of latency = alpha + beta * size."""
    beta, alpha = np.polyfit(np.asarray(sizes_bytes, float), np.asarray(latencies_s, float), 1)
    return max(float(alpha), 0.0), float(beta)


def _skrull_fits() -> dict[str, tuple[float, float]]:
    sizes = [mb * 2**20 for mb in SKRULL_SIZES_MB]
    return {k: fit_alpha_beta(sizes, [t * 1e-6 for t in v]) for k, v in SKRULL_H100_TABLE_US.items()}


class CommModel:
    """Collective and point-to-point times for one cluster."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        # Bytes per second of "algorithm bandwidth" per unit ring factor, from the fit.
        self._fits = {}
        for kind, (alpha, beta) in _skrull_fits().items():
            bus_bytes_per_s = ring_factor(kind, SKRULL_RANKS) / beta
            self._fits[kind] = (alpha, bus_bytes_per_s / (SKRULL_LINK_GBPS * 1e9))  # efficiency

    def _link(self, inter_node: bool) -> tuple[float, float]:
        c = self.cluster
        if inter_node:
            return c.inter_latency_us * 1e-6, c.inter_bw_gbps * 1e9
        return c.intra_latency_us * 1e-6, c.intra_bw_gbps * 1e9

    def collective_time(self, kind: str, nbytes: float, *, ranks: int, inter_node: bool) -> float:
        """Seconds for a collective over `ranks` ranks on a buffer of `nbytes` (the full,
        gathered size for all-gather; the input size for the others)."""
        if kind not in self._fits:
            raise UserError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVES)}")
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        fitted_alpha, efficiency = self._fits[kind]
        latency, bandwidth = self._link(inter_node)
        alpha = max(fitted_alpha, latency) if not inter_node else fitted_alpha + latency
        if inter_node:
            efficiency = INTER_NODE_EFFICIENCY
        return alpha + ring_factor(kind, ranks) * nbytes / (efficiency * bandwidth)

    def p2p_time(self, nbytes: float, *, inter_node: bool) -> float:
        if nbytes <= 0:
            return 0.0
        latency, bandwidth = self._link(inter_node)
        return latency + nbytes / bandwidth
