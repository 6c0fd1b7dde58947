"""SlimPack (slimpack.txt): MicroPacks of equal FLOPs, asymmetric backward grouping, DP-Merge.

planner.py (the registry's entry: `plan_slimpack` and the sweep that picks the MicroPack count by
simulation) builds on build.py (one pipeline for a fixed count), schedule.py (PackFlow 1F1B),
cuts.py (MicroPack cuts), pieces.py (the MicroPacks of many streams at once, by numpy) and dp.py
(Phase 1 and DP-Merge).
"""
