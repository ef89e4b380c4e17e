"""Train a zoo model with autopar.parallel.step.compile_step, in one process or under torchrun.

One process::

    .venv/bin/python examples/train_distributed.py --model mlp --mode auto

Two processes on this machine (gloo on CPU; nccl on GPUs)::

    .venv/bin/torchrun --nproc_per_node=2 examples/train_distributed.py --model inception

Every rank builds the same model and passes the same GLOBAL batch; compile_step splits it.
The checkpoint is the plain state_dict of the model and loads under any world size.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn as nn

from autopar.parallel.step import compile_step
from autopar.tools import zoo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp", choices=["mlp", "inception", "lstm", "deep_mlp"])
    ap.add_argument("--mode", default="auto", choices=["auto", "data", "pipeline", "none"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--save", default=None, help="write the state_dict here at the end")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    model, (x,) = zoo.build(args.model, seed=0)  # same seed on every rank
    with torch.no_grad():
        y = torch.randn_like(model(x))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = compile_step(model, nn.MSELoss(), opt, distributed=args.mode, timeout=120)
    for i in range(args.steps):
        loss = step(x, target=y)  # the global batch; the same loss on every rank
        if step.env.rank == 0:
            print(f"step {i}: loss {loss.item():.6f}")
    state = step.state_dict()  # collective in pipeline mode: every rank calls it
    if step.env.rank == 0:
        print(step.summary())
        if args.save:
            torch.save(state, args.save)


if __name__ == "__main__":
    main()
