"""Peak memory of the LM head with its loss, forward and backward, at full size on this CPU
(fake tensors, measured as `lengthwise dryrun` measures): the blocked head of the executor
(`model.head_loss`, `runtime/loss.head_loss_sum`) beside the plain loss of whole logits
(`loss.token_loss_sum(model.head_logits(h))`, the executor's head before issue 26), and the
cost model's figure for the blocked one (`cost/memory.py`: kept tensors plus the larger of the
forward's and the backward's working sets).

    python benchmarks/bench_head_memory.py      # writes benchmarks/results/head_memory.json

Bytes beyond the head's weights (and its bf16 input, the caller's); bf16 compute.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lengthwise.cost.memory as mem
from lengthwise.files import write_atomic
from lengthwise.runtime.flop_formulas import cpu_flash_flop_formulas
from lengthwise.runtime.measure import CommBytes, LocalFlopCounter, _Measuring, _StorageTracker
from lengthwise.runtime.loss import token_loss_sum
from lengthwise.runtime.model import CausalLM, StagePart
from lengthwise.specs import model_preset

RESULTS = Path(__file__).parent / "results"
GIB = 2**30


def peak_bytes(spec, tokens: int, *, blocked: bool) -> int:
    """Highest level of what the head's forward and backward allocate (every category)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = _StorageTracker()
        with tracker, _Measuring(tracker, LocalFlopCounter(display=False, custom_mapping=cpu_flash_flop_formulas()),
                                 CommBytes()):
            model = CausalLM(spec, StagePart(layers=range(0), first=False, last=True), torch.bfloat16)
            h = torch.randn(tokens, spec.hidden, dtype=torch.bfloat16, requires_grad=True)
            labels = torch.zeros(tokens, dtype=torch.long)
            loss = model.head_loss(h, labels) if blocked else token_loss_sum(model.head_logits(h), labels)
            loss.backward()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return int(peak - weights)  # the weights, made inside the tracker, are counted; the input is not


def modelled_bytes(spec, tokens: int) -> float:
    kept = mem.head_bytes_per_token(spec) * tokens
    return kept + max(float(mem.head_forward_bytes(spec, tokens)),
                      float(mem.backward_work_bytes(spec, tokens, layers=0, head=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--out", default=str(RESULTS / "head_memory.json"))
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        spec = model_preset(name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            blocked, plain = peak_bytes(spec, tokens, blocked=True), peak_bytes(spec, tokens, blocked=False)
            row = {"model": name, "tokens": tokens, "blocked_peak_gib": blocked / GIB, "plain_peak_gib": plain / GIB,
                   "plain_over_blocked": plain / blocked, "modelled_blocked_gib": modelled_bytes(spec, tokens) / GIB}
            rows.append(row)
            print(f"{name:14s} {tokens:6d} tokens: blocked {row['blocked_peak_gib']:6.2f} GiB "
                  f"(cost model {row['modelled_blocked_gib']:6.2f}), plain {row['plain_peak_gib']:6.2f} GiB",
                  flush=True)
    write_atomic(Path(args.out), json.dumps({"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
                                             "machine": platform.processor() or platform.machine(),
                                             "block_bytes": mem.HEAD_BLOCK_BYTES, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
