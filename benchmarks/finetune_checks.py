"""What bench_gpu_finetune.py checks in its results: issue 8's targets at the first context, and
ChunkFlow's throughput over every other system measured in the same run (the transformers rows
named by their attention implementation, so a ratio over transformers says which path it beat).
"""

from __future__ import annotations


def check_targets(models: dict, s) -> list[dict]:  # s: bench_gpu_finetune.Settings
    """Issue 8's targets at the first context length."""
    checks, ctx = [], s.contexts[0]
    for name, entry in models.items():
        runs = {r["system"]: r for r in entry.get("runs", []) if r["context"] == ctx}
        cf = runs.get("chunkflow", {})
        for base, target in (("hf-padded", 2.0), ("packing", 1.1)):
            value = (cf["tokens_per_s"] / runs[base]["tokens_per_s"]
                     if "tokens_per_s" in cf and "tokens_per_s" in runs.get(base, {}) else None)
            checks.append(_check(f"{name} @{ctx}: chunkflow / {base} tokens/s", value, target))
        if "1.5b" in name:
            checks.append(_check(f"{name} @{ctx}: chunkflow MFU", cf.get("mfu"), 0.45))
        if "memory_scan" in entry:
            checks.append(_check(f"{name}: chunkflow peak minus K/V spread over the scan", entry["memory_scan_spread"],
                                 0.10, at_most=True))
    return checks


def chunkflow_ratios(models: dict) -> list[dict]:
    """ChunkFlow's tokens/s over every other system's at the same context, measured in this one
    process; transformers rows name their attention (the anchor is the best one available)."""
    ratios = []
    for name, entry in models.items():
        for cf in (r for r in entry.get("runs", []) if r["system"] == "chunkflow" and "tokens_per_s" in r):
            for base in entry["runs"]:
                if base["system"] != "chunkflow" and base["context"] == cf["context"] and "tokens_per_s" in base:
                    label = base["system"] + (f" ({base['attn_implementation']})" if "attn_implementation" in base
                                              else "")
                    ratios.append({"model": name, "context": cf["context"], "ratio": f"chunkflow / {label} tokens/s",
                                   "value": cf["tokens_per_s"] / base["tokens_per_s"]})
    return ratios


def _check(name: str, value, target: float, at_most: bool = False) -> dict:
    met = None if value is None else (value <= target if at_most else value >= target)
    return {"check": name, "value": value, "target": ("<= " if at_most else ">= ") + f"{target}", "met": met}
