"""PyTorch DDP's side of `make bench-peers`: one rank of synchronous data-parallel training.

Trains flotilla's zoo models (models/zoo.cpp) on Fashion-MNIST with torch.distributed (gloo)
and DistributedDataParallel (default buckets), SGD with momentum, cross-entropy from logits.
Each step, every rank takes its slice of one shuffled global batch from tensors in memory.
Runs `steps` untimed warm-up steps, then times `steps` more between two barriers; rank 0
prints one JSON line with the global samples per second.

Settings (bench/peers.sh runs DDP at flotilla's precision twice: as a DDP user writes it by
default, and at the fastest settings found for this CPU):
  PRECISION  float32, or mixed_bfloat16: forward and loss under torch.autocast("cpu",
             dtype=torch.bfloat16), as flotilla's mixed_bfloat16 (float32 weights and optimizer)
  LAYOUT     nchw (PyTorch's default), or channels_last: the model and each batch in
             torch.channels_last (a no-op for models without 2-D convolutions)
  OPTIMIZER  default (torch.optim.SGD as constructed by default: its per-parameter loop on the
             CPU), or fused (SGD(fused=True): one kernel over every parameter)
  ORDER      relu-pool (the CNN as usually written: ReLU, then max-pool), or pool-relu (max-pool
             first: the same values, ReLU on a quarter of the elements; common.make_torch_model)
  ATTENTION  default (scaled_dot_product_attention picks its backend: flash attention for the
             CPU), math (torch.nn.attention.sdpa_kernel(SDPBackend.MATH): matmul, softmax,
             matmul; ViT-tiny's step 1.19x faster under bf16 autocast here, level in float32),
             or weights (nn.MultiheadAttention(need_weights=True): its own bmm, softmax, bmm,
             and the heads' averaged weights; under bf16 autocast 1.035x faster than math here,
             level in float32)
  COMPILE    eager, or inductor: torch.compile(model) (Inductor's CPU code generation; DDP's
             optimizer splits the graph at its buckets). Its compile time falls in the warm-up
             steps, which are not timed; "warmup_seconds" in the line says how long they took

Started once per rank by bench/peers.sh, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in the environment.
Usage: python ddp_train.py MODEL GLOBAL_BATCH STEPS [THREADS] [DATA_DIR] [PRECISION] [LAYOUT]
       [OPTIMIZER] [ORDER] [ATTENTION] [COMPILE]
"""
import contextlib
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
    precision = sys.argv[6] if len(sys.argv) > 6 else "float32"
    layout = sys.argv[7] if len(sys.argv) > 7 else "nchw"
    optimizer_kind = sys.argv[8] if len(sys.argv) > 8 else "default"
    order = sys.argv[9] if len(sys.argv) > 9 else "relu-pool"
    attention = sys.argv[10] if len(sys.argv) > 10 else "default"
    compile_kind = sys.argv[11] if len(sys.argv) > 11 else "eager"
    if precision not in ("float32", "mixed_bfloat16") or layout not in ("nchw", "channels_last") \
            or optimizer_kind not in ("default", "fused") or order not in ("relu-pool", "pool-relu") \
            or attention not in ("default", "math", "weights") \
            or compile_kind not in ("eager", "inductor"):
        raise SystemExit(f"bad settings {precision} {layout} {optimizer_kind} {order} {attention}")
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
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
    model = DistributedDataParallel(
        make_torch_model(model_name, pool_first=order == "pool-relu",
                         need_weights=attention == "weights").to(memory_format=fmt))
    forward = torch.compile(model) if compile_kind == "inductor" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                                **({"fused": True} if optimizer_kind == "fused" else {}))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) \
        if precision == "mixed_bfloat16" else contextlib.nullcontext

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
            xb, yb = x.index_select(0, idx).to(memory_format=fmt), y.index_select(0, idx)
            with autocast():
                logits = forward(xb)
                loss = F.cross_entropy(logits, yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # Running metrics like Keras' and flotilla's, without a sync per step.
            loss_sum += loss.detach()
            correct += (logits.detach().argmax(1) == yb).sum()

    stack = contextlib.ExitStack()
    if attention == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    warmup_start = time.perf_counter()
    train(steps)  # warm-up (and torch.compile's compilation)
    dist.barrier()
    warmup_seconds = time.perf_counter() - warmup_start
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
            "version": torch.__version__, "precision": precision, "memory_format": layout,
            "optimizer": "SGD" + (" fused" if optimizer_kind == "fused" else ""),
            "relu_pool_order": order, "attention": attention, "compile": compile_kind,
            "warmup_seconds": warmup_seconds,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
