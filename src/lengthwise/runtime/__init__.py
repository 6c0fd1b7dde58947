"""The executor: runs a StepPlan in PyTorch with exactly the loss and gradients of plain training.

    from lengthwise.runtime.model import build_model
    from lengthwise.runtime.execute import run_step
    model = build_model(plan.model, dtype=torch.float64, seed=0)    # or load_weights(model, "ckpt/")
    loss = run_step(model, plan, token_ids)   # token_ids[seq_id]: 1-D LongTensor; grads land in .grad

The only part of lengthwise that imports torch. Floors, each importing only below:
model.py (the decoder, HF names; layer_ops.py its layers' autograd Functions; compile.py compiles its
layers) <- attention.py (backends:
reference, and flash_row.py's row structure over flash_cpu.py's or flash_varlen.py's kernels)
<- layout.py (which keys each query of a packed row sees; RowIndex, built once per chunk) ; loss.py (labels,
cross-entropy) ; state.py (K/V store) <- cells.py (forward chunks cut by backward units) ;
transport.py (stage-to-stage messages) <- stage.py
(one stage's state-aware runner) <- checks.py, execute.py (single-process driver) <- verify.py
(comparison with transformers). weights.py reads and writes Hugging Face checkpoints and
memory.py measures what autograd keeps for backward. manifest.py (sha256 of a checkpoint's
files, written last, checked before any is read) <- checkpoint.py (training checkpoints as
JSON and safetensors).

The package itself imports nothing, so that its pure-Python parts (train/config.py) load without
torch: `lengthwise --help` and the planning commands run where PyTorch is not installed.
"""
