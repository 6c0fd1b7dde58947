"""`lengthwise train`: config.py (options, no PyTorch) below step.py (one batch's forward and
backward) below executor.py (one step's plan) below loop.py (the single-process loop) below
dist.py (the same loop across processes).

Beside them, each used by the loop: signals.py (Ctrl-C / SIGTERM as a flag read between
steps), outputs.py (the output folder's lock, default name, metrics file; no PyTorch),
schedule.py (learning-rate warm-up and decay, settings changed on resume, non-finite
gradients), heldout.py (the held-out loss), report.py (progress bar, metrics, TensorBoard) and
memory_check.py (will the run fit, before it starts).
"""
