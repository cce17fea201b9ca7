"""The FLOPs a training step does per sample, and this CPU's matmul peak: what bench/peers.sh
divides by to give each system's share of the machine.

  flops MODEL   one JSON line: forward and training (forward + backward) FLOPs per sample of
                the model's PyTorch twin (common.py), counted by torch.utils.flop_counter (every
                matmul and convolution, backward included: the first convolution computes no
                input gradient; it leaves out the CPU's fused attention kernel: ViT-tiny's
                attention, 11.5 MFLOP of 277 per forward, is not in its count). The CNN's count
                equals the hand count: forward 8,482,304
                (conv 451,584 + conv 7,225,344 + linear 802,816 + linear 2,560); training
                3 x forward - 451,584 (the first input gradient) = 24,995,328.
  peak          one JSON line: one thread's matmul rate in GFLOP/s, float32 and bfloat16 (the
                median of 7 timings of a 1024 x 1024 GEMM, torch.mm, after 3 untimed)
"""
import json
import sys
import time

import torch

from common import make_torch_model


def flops(name):
    from torch.utils.flop_counter import FlopCounterMode
    model = make_torch_model(name)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    forward = FlopCounterMode(display=False)
    with forward:
        model(x)
    training = FlopCounterMode(display=False)
    with training:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return {"model": name, "forward_flops_per_sample": forward.get_total_flops() // 8,
            "train_flops_per_sample": training.get_total_flops() // 8}


def peak():
    torch.set_num_threads(1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        for _ in range(3):
            torch.mm(a, b)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        out[str(dtype).split(".")[1]] = 2 * 1024 ** 3 / sorted(times)[3] / 1e9
    return {"matmul_gflops_per_thread": {k: round(v, 1) for k, v in out.items()}}


if __name__ == "__main__":
    if sys.argv[1] == "flops":
        print(json.dumps(flops(sys.argv[2])))
    elif sys.argv[1] == "peak":
        print(json.dumps(peak()))
    else:
        raise SystemExit("usage: utilisation.py flops MODEL | peak")
