"""Write a training checkpoint as a Hugging Face model folder (config.json + model.safetensors)
that `transformers` loads.

    lengthwise train --out run/                     # checkpoints run/step-000040/ ...
    lengthwise export run/step-000040 --hf my-model/
    lengthwise export run/ --hf my-model/           # the newest intact checkpoint under run/

The checkpoint is checked against its manifest first (a damaged one is refused by name; from a
run folder the newest intact step is exported, and the step chosen and the newer ones skipped
are named on stderr). A single-process checkpoint holds the weights under their Hugging Face
names already; a distributed one holds each rank's shards (safetensors + JSON), consolidated
here one tensor at a time, with the model's config.json from the checkpoint or --model-config.
A distributed checkpoint of an earlier lengthwise (pickled torch.distributed.checkpoint files)
is refused unless --allow-pickle-checkpoint is given, for a run of your own.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lengthwise.errors import UserError
from lengthwise.paths import check_writable


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder (step-NNNNNN) or a run folder")
    parser.add_argument("--hf", metavar="OUT", required=True, help="folder to write config.json and model.safetensors")
    parser.add_argument("--model-config", metavar="config.json",
                        help="the model's Hugging Face config, for a checkpoint that does not carry one")
    parser.add_argument("--allow-pickle-checkpoint", action="store_true",
                        help="read a distributed checkpoint of an earlier lengthwise, whose pickled files can run "
                             "code when loaded: only for a run of your own")


def run(args: argparse.Namespace) -> int:
    check_output_folder(args.hf)
    from lengthwise.runtime.export import export_checkpoint

    written = export_checkpoint(args.checkpoint, args.hf, model_config=args.model_config,
                                allow_pickle=args.allow_pickle_checkpoint)
    print(f"wrote {written} (config.json, model.safetensors): load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(written)!r})")
    return 0


def check_output_folder(path: str) -> None:
    """--hf names a folder that can be created and written, before the checkpoint is read."""
    if Path(path).exists() and not Path(path).is_dir():
        raise UserError(f"--hf {path} is a file; give a folder to write config.json and model.safetensors into")
    check_writable(Path(path) / "config.json", "--hf")
