"""Skrull (skrull.txt): dynamic data scheduling for long-context SFT.

planner.py (the registry's entry: `plan_skrull`) builds on dacp.py (which sequences of a
micro-batch are sharded over the context-parallel group).
"""
