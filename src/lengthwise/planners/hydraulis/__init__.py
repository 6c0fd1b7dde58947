"""Hydraulis (hydraulis.txt): dynamic heterogeneous strategies and two-stage sequence assignment.

planner.py (the registry's entry: `plan_hydraulis`) builds on strategy.py (strategy proposal),
dispatch.py (sequences onto pipelines), packing.py (micro-batches within a pipeline) and cost.py
(the scheme space and its cost model).
"""
