"""Hydraulis (hydraulis.txt): dynamic heterogeneous strategies and two-stage sequence assignment.

planner.py (the registry's entry: `plan_hydraulis`) builds on evaluate.py (a candidate strategy's
bound, dispatch and packing), strategy.py (strategy proposal), dispatch.py and trials.py
(sequences onto pipelines: longest-first and random trials, over arrays.py's pipeline arrays),
packing.py (micro-batches within a pipeline) and cost.py (the scheme space and its cost model).
"""
