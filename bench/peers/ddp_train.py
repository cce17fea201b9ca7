"""PyTorch DDP's side of `make bench-peers`: one rank of synchronous data-parallel training.

Trains flotilla's zoo models (models/zoo.cpp) on Fashion-MNIST with torch.distributed (gloo)
and DistributedDataParallel (default buckets), SGD with momentum, cross-entropy from logits.
Each step, every rank takes its slice of one shuffled global batch from tensors in memory.
Runs `steps` untimed warm-up steps, then times `steps` more between two barriers; rank 0
prints one JSON line with the global samples per second.

Started once per rank by bench/peers.sh, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in the environment.
Usage: python ddp_train.py MODEL GLOBAL_BATCH STEPS [THREADS] [DATA_DIR]
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from common import LR, MEAN, MOMENTUM, SEED, STD, make_torch_model, parse_args, read_idx  # noqa: E402




def main():
    model_name, global_batch, steps, threads, data_dir = parse_args(sys.argv)
    torch.set_num_threads(threads)

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the env
    rank, world = dist.get_rank(), dist.get_world_size()
    if global_batch % world:
        raise SystemExit(f"global batch {global_batch} is not divisible by {world} ranks")
    local_batch = global_batch // world

    images = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"))
    x = torch.from_numpy((images.astype(np.float32) / 255.0 - MEAN) / STD).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    n = x.shape[0]

    torch.manual_seed(SEED)  # DDP broadcasts rank 0's parameters anyway
    model = DistributedDataParallel(make_torch_model(model_name))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def local_batches():
        """This rank's slice of each global batch; every rank draws the same permutation."""
        generator = torch.Generator().manual_seed(SEED)
        while True:
            perm = torch.randperm(n, generator=generator)
            for start in range(0, n - global_batch + 1, global_batch):
                yield perm[start + rank * local_batch:start + (rank + 1) * local_batch]

    batches = local_batches()
    loss_sum = torch.zeros(())
    correct = torch.zeros((), dtype=torch.int64)

    def train(count):
        nonlocal loss_sum, correct
        model.train()
        for _ in range(count):
            idx = next(batches)
            xb, yb = x.index_select(0, idx), y.index_select(0, idx)
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # Running metrics like Keras' and flotilla's, without a sync per step.
            loss_sum += loss.detach()
            correct += (logits.detach().argmax(1) == yb).sum()

    train(steps)  # warm-up
    dist.barrier()
    start = time.perf_counter()
    loss_sum.zero_()
    correct.zero_()
    train(steps)
    dist.barrier()
    seconds = time.perf_counter() - start

    if rank == 0:
        print(json.dumps({
            "system": "pytorch-ddp", "model": model_name, "global_batch": global_batch,
            "workers": world, "threads": threads, "steps": steps, "seconds": seconds,
            "samples_per_s": steps * global_batch / seconds,
            "loss": loss_sum.item() / steps, "accuracy": correct.item() / (steps * local_batch),
            "version": torch.__version__,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
