"""Running a StepPlan across processes on torch.distributed (gloo on CPU, NCCL on GPUs).

    torchrun --nproc-per-node 4 -m lengthwise verify --dp 2 --pp 2
    lengthwise verify --nproc 4 --dp 2 --cp 2 --planner skrull --option bucket_size=160

One module per concern, each importing only those before it:
mesh.py (which rank runs which pipeline/stage/CP rank; process groups, cached) ; stats.py
(elements sent, per rank) <- p2p.py (a torch.distributed Transport: isend / irecv with a
time-out) ; dp.py (same plan on every rank, gradient sums over the ranks holding each
parameter) ; agree.py (rank 0's JSON broadcast, the same training settings on every rank) ;
cp.py (head-tail sharding, K/V all-gather attention) <- cp_stage.py (the rows one
CP rank computes: a StageRunner's `rows`) <- step.py (one rank's step) ; forkserver.py (the server local workers fork from, torch-free)
<- launch.py (torchrun or local workers) <-
verify_dist.py (distributed run vs the oracle), checkpoint_dist.py (torch.distributed.checkpoint
plus sampler and RNG per rank, sealed by a manifest). Training across processes (`lengthwise train --nproc` or under
torchrun) is runtime/train/dist.py.

A rank builds only its stage's modules, parallelised from outside the model by
`runtime/parallel/` (one (pp, dp, cp, tp) DeviceMesh; DTensor TP; FSDP2 over dp x cp).
The model file imports no parallel code: a stage runner runs its stage's layers, and context
parallelism enters only as the attention callable the CP rows hand to the model.
"""
