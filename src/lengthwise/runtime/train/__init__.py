"""`lengthwise train`: config.py (options, no PyTorch) below step.py (one batch's forward and
backward) below executor.py (one step's plan) below loop.py (the single-process loop) below
dist.py (the same loop across processes).
"""
