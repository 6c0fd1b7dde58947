"""What one rank sent during a step, counted where it is sent, to compare with the cost model.

Counts are tensor *elements* (multiply by the element size for bytes; the cost model counts
bfloat16 bytes, 2 per element, whatever dtype the executor runs), and follow the logical
volume, not a particular algorithm's wire traffic:

- p2p: elements of every activation and activation-gradient this rank sends to a neighbour
  stage (cost model: `boundary_bytes` per message);
- dp: elements of the gradient buffers this rank hands to the all-reduce (cost model:
  `stage_params` of the stage, the buffer `grad_sync_time` charges); a ring all-reduce puts
  2 (n-1)/n of that on the wire. Under FSDP2: the unsharded gradient elements handed to its
  reduce-scatters (parameter all-gathers are not counted);
- cp_gather: elements of K/V this rank contributes to the CP all-gathers times the (c - 1)
  peers that receive them (cost model: `cp_comm_time`'s volume, tokens x 2 kv_dim per layer,
  times the ring factor (c-1)/c); cp_scatter the same for the K/V-gradient reduce-scatter in
  backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(kw_only=True)
class CommStats:
    """Elements and calls one rank sent in one step (and how long it waited to receive)."""

    p2p_elements: int = 0
    """Activation / gradient elements sent to neighbour stages."""
    p2p_messages: int = 0
    """Point-to-point sends."""
    dp_elements: int = 0
    """Gradient elements all-reduced across the data-parallel (and CP) holders of a parameter."""
    dp_buckets: int = 0
    """All-reduce calls (buckets)."""
    cp_gather_elements: int = 0
    """K/V elements sent to CP peers in forward all-gathers (own share x (c - 1))."""
    cp_scatter_elements: int = 0
    """K/V-gradient elements sent to CP peers in backward reduce-scatters ((c - 1)/c of the buffer)."""
    cp_calls: int = 0
    """CP collectives (all-gather plus reduce-scatter)."""
    wait_s: float = 0.0
    """Seconds blocked on point-to-point transfers: receives (waiting for a neighbour stage,
    the bubbles this rank sees) and the final wait for its sends."""

    def add(self, other: CommStats) -> CommStats:
        return CommStats(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    def to_dict(self) -> dict:
        return asdict(self)
