"""PyTorch's side of the GPU benchmark (bench/gpu/run.sh): the training step flotilla's
gpu_train_bench times, written the way a PyTorch user would write it.

The same layers as flotilla's models/zoo.cpp, the same kind of input (a few random batches of
[N, 1, 28, 28] images and int64 labels, resident on the device), SGD(lr=0.01, momentum=0.9)
(Adam/AdamW as in train_bench.cpp), cross-entropy from logits. Precisions: float32; bfloat16
autocast; float16 autocast with torch.amp.GradScaler. Memory formats: PyTorch's default (NCHW)
and channels_last (model and batches, as flotilla keeps conv models by default); --pool-first
writes the CNN's max-pools before their ReLUs, as flotilla's zoo computes it. Modes: eager;
torch.compile of the model (default mode; the optimizer step stays eager, as in most code); and
compile-graphs, torch.compile's mode="reduce-overhead", which replays the compiled forward and
backward as CUDA graphs (PyTorch's answer to flotilla's jit_compile). The timed loop reads
nothing back to the host (no .item()) and zero_grad sets gradients to None. After `warmup`
untimed steps (compilation happens there) the device is synchronised, `steps` steps are timed,
and it is synchronised again. One JSON line per configuration, in train_bench.cpp's shape; a
configuration that fails prints {"bench":"gpu_train","error":...} and the others still run
(the exit status is then 1).

Needs only torch. On a CPU-only machine: --device cpu --steps 3 --modes eager.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

# The layers are the DDP peer's (bench/peers/common.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from common import make_torch_model  # noqa: E402

PRECISIONS = {  # flag -> (the name train_bench.cpp prints, autocast dtype or None)
    "float32": ("float32", None),
    "fp32": ("float32", None),
    "mixed_bfloat16": ("mixed_bfloat16", torch.bfloat16),
    "bf16": ("mixed_bfloat16", torch.bfloat16),
    "mixed_float16": ("mixed_float16", torch.float16),
    "fp16": ("mixed_float16", torch.float16),
}




IMPLS = {"eager": "torch-eager", "compile": "torch-compile",
         "compile-graphs": "torch-compile-graphs"}


def make_optimizer(name, parameters):
    # Keras's epsilon (1e-7) and AdamW decay (0.004), as flotilla's optimizers use.
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=1e-3, eps=1e-7)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-3, eps=1e-7, weight_decay=0.004)
    raise ValueError(f"unknown optimizer {name!r}; use sgd, adam or adamw")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(args, device, mode, precision_flag, memory_format):
    precision, dtype = PRECISIONS[precision_flag]
    fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
    torch.manual_seed(args.seed)
    images = torch.randn(args.distinct_batches, args.batch, 1, 28, 28, device=device)
    images = torch.stack([b.to(memory_format=fmt) for b in images])  # each batch in `fmt`
    labels = torch.randint(0, 10, (args.distinct_batches, args.batch), device=device)
    model = make_torch_model(args.model, pool_first=args.pool_first).to(device).to(
        memory_format=fmt)
    optimizer = make_optimizer(args.optimizer, model.parameters())
    forward = (torch.compile(model) if mode == "compile" else
               torch.compile(model, mode="reduce-overhead") if mode == "compile-graphs" else model)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def step(i):
        if mode == "compile-graphs":
            torch.compiler.cudagraph_mark_step_begin()  # last step's graph outputs may go
        x, y = images[i % args.distinct_batches].to(memory_format=fmt), \
            labels[i % args.distinct_batches]
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(forward(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step(0)  # torch.compile compiles here
    synchronize(device)
    first_step_s = time.perf_counter() - start
    for i in range(1, args.warmup):
        step(i)
    synchronize(device)
    start = time.perf_counter()
    for i in range(args.steps):
        step(i)
    synchronize(device)
    seconds = time.perf_counter() - start

    # The same sanity figure as train_bench.cpp: the loss on the first batch after training.
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype or torch.float32,
                                         enabled=dtype is not None):
        final_loss = F.cross_entropy(model(images[0]).float(), labels[0]).item()
    line = {
        "bench": "gpu_train",
        "impl": IMPLS[mode],
        "model": args.model,
        "batch": args.batch,
        "precision": precision,
        "memory_format": memory_format,
        "relu_pool_order": "pool-relu" if args.pool_first else "relu-pool",
        "cuda_graph": mode == "compile-graphs",
        "workers": 1,
        "samples_per_s": args.steps * args.batch / seconds,
        "step_ms": seconds * 1000 / args.steps,
        "final_loss": final_loss,
        "device": str(device),
        "optimizer": args.optimizer,
        "steps": args.steps,
        "warmup": max(args.warmup, 1),
        "first_step_s": round(first_step_s, 3),
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        line["device_name"] = torch.cuda.get_device_name(device)
    return line


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn",
                        choices=["mlp", "mlp-wide", "cnn", "resnet20", "resnet18", "vit-tiny"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--modes", default="eager,compile",
                        help="comma-separated: eager, compile, compile-graphs")
    parser.add_argument("--precisions", default="float32,mixed_bfloat16,mixed_float16",
                        help="comma-separated: float32 (fp32), mixed_bfloat16 (bf16), "
                             "mixed_float16 (fp16)")
    parser.add_argument("--memory-formats", default="nchw,channels_last",
                        help="comma-separated: nchw, channels_last")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    parser.add_argument("--distinct-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--pool-first", action="store_true",
                        help="the CNN's max-pools before their ReLUs (the same values; what "
                             "flotilla's zoo computes)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    precisions = [p for p in args.precisions.split(",") if p]
    formats = [f for f in args.memory_formats.split(",") if f]
    bad = [m for m in modes if m not in IMPLS] + \
          [p for p in precisions if p not in PRECISIONS] + \
          [f for f in formats if f not in ("nchw", "channels_last")]
    if bad or args.batch < 1 or args.steps < 1 or args.warmup < 0:
        parser.error(f"bad --modes/--precisions {bad} or non-positive --batch/--steps")
    device = torch.device(args.device)

    failed = False
    for mode, precision, memory_format in [(m, p, f) for m in modes for p in precisions
                                           for f in formats]:
        try:
            line = run_one(args, device, mode, precision, memory_format)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not end the run
            failed = True
            line = {"bench": "gpu_train",
                    "impl": IMPLS[mode],
                    "model": args.model, "batch": args.batch,
                    "precision": PRECISIONS[precision][0], "memory_format": memory_format,
                    "device": str(device),
                    "error": f"{type(e).__name__}: {e}".splitlines()[0][:500]}
        print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
