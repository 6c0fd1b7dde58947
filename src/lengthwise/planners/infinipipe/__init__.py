"""InfiniPipe (infinipipe.txt): elastic pipeline parallelism with workload-balanced chunks.

planner.py (the registry's entry: `plan_infinipipe`) builds on search.py (the slice-number search),
grouping.py (units into 1F1B groups), ckpt.py (adaptive checkpointing MILP), schedule.py (one
group's schedule and memory), unit_costs.py (each unit's per-stage bytes and seconds, memoised;
segment_arrays.py, the segments of many units as arrays) and chunking.py (workload-balanced
chunks).
"""
