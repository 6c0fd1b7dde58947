"""ChunkFlow (chunkflow.txt): uniform chunks, state-aware 1F1B, a grid over ChunkSize and K.

planner.py (the registry's entry: `plan_chunkflow` and the grid search) builds on build.py
(chunk construction and one pipeline's plan for a fixed ChunkSize and K).
"""
