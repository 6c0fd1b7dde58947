"""Parallelism applied to a stage's model from outside (as torchtitan does): the model file
knows nothing of meshes.

device_mesh.py: one `DeviceMesh` with dimensions (pp, dp, cp, tp) laid over the plan's ranks
(`distributed/mesh.PlanLayout`), and the flattened dp x cp dimension FSDP2 shards over.
tensor_parallel.py: `parallelize_module` plans (Colwise / Rowwise) for a stage's modules.
fsdp.py: `fully_shard` per decoder layer and the stage's root, mixed precision, and the
per-step switches (gradient sync only in the stage's last backward) the executor calls.
"""
