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
  convs MODEL [BATCH]
                a JSON line per distinct convolution of the twin (BATCH images, default 64,
                channels-last, one thread) and precision (float32; bfloat16 weights and inputs,
                as autocast hands them to oneDNN): the median of 15 timings of its forward and of
                its forward and backward, each as GFLOP/s and as a share of the peak above; then
                one line of all its convolutions' training time per step. The kernels are
                oneDNN's, the ones every side calls (flotilla through LibTorch, TF through its
                own build of oneDNN)
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


def median_s(f, runs=15):
    """The median of `runs` timings of f(), after 3 untimed."""
    for _ in range(3):
        f()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[runs // 2]


def peak():
    torch.set_num_threads(1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        out[str(dtype).split(".")[1]] = 2 * 1024 ** 3 / median_s(lambda: torch.mm(a, b), 7) / 1e9
    return {"matmul_gflops_per_thread": {k: round(v, 1) for k, v in out.items()}}


def convs(name, batch):
    torch.set_num_threads(1)
    rates = peak()["matmul_gflops_per_thread"]
    shapes = {}  # (in, out, kernel, stride, padding, input size) -> how many
    model = make_torch_model(name)

    def record(m, inputs, output):
        key = (m.in_channels, m.out_channels, m.kernel_size[0], m.stride[0], m.padding[0],
               inputs[0].shape[-1])
        shapes[key] = shapes.get(key, 0) + 1
    hooks = [m.register_forward_hook(record)
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    model(torch.randn(1, 1, 28, 28))
    for h in hooks:
        h.remove()
    lines, total = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        precision = str(dtype).split(".")[1]
        for (cin, cout, k, stride, pad, size), count in shapes.items():
            conv = torch.nn.Conv2d(cin, cout, k, stride, pad, bias=False).to(dtype)
            conv = conv.to(memory_format=torch.channels_last)
            x = torch.randn(batch, cin, size, size, dtype=dtype)
            x = x.to(memory_format=torch.channels_last).requires_grad_(cin > 1)
            y = conv(x)
            grad = torch.randn_like(y)
            flops = 2 * batch * cout * y.shape[2] * y.shape[3] * cin * k * k
            # The first convolution computes no input gradient: 2 products instead of 3.
            train_flops = flops * (3 if cin > 1 else 2)

            def step():
                conv.weight.grad = x.grad = None
                conv(x).backward(grad)
            forward_s = median_s(lambda: conv(x))
            train_s = median_s(step)
            total[precision] = total.get(precision, 0) + count * train_s
            lines.append({"model": name, "batch": batch, "precision": precision,
                          "conv": f"{cin}->{cout} {k}x{k}/{stride} at {size}x{size}",
                          "count": count,
                          "forward_ms": round(forward_s * 1e3, 3),
                          "forward_share_of_peak": round(flops / forward_s / 1e9 / rates[precision], 3),
                          "train_ms": round(train_s * 1e3, 3),
                          "train_share_of_peak": round(train_flops / train_s / 1e9 / rates[precision], 3)})
    lines.append({"model": name, "batch": batch, "metric": "conv_train_ms_per_step",
                  **{k: round(v * 1e3, 1) for k, v in total.items()},
                  "matmul_gflops_per_thread": rates})
    return lines


if __name__ == "__main__":
    if sys.argv[1] == "flops":
        print(json.dumps(flops(sys.argv[2])))
    elif sys.argv[1] == "peak":
        print(json.dumps(peak()))
    elif sys.argv[1] == "convs":
        for line in convs(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 64):
            print(json.dumps({"bench": "convs", **line}))
    else:
        raise SystemExit("usage: utilisation.py flops MODEL | peak | convs MODEL [BATCH]")
