"""What the peer scripts share: the IDX reader, the training constants flotilla uses, and the
PyTorch layers of flotilla's model zoo (for the DDP peer and bench/gpu/torch_peer.py)."""
import gzip
import os

import numpy as np

MEAN, STD = 0.2860, 0.3530
LR, MOMENTUM, SEED = 0.04, 0.9, 42


def read_idx(path):
    """An IDX file (gzip) as a numpy array of uint8."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def parse_args(argv):
    """MODEL GLOBAL_BATCH STEPS [THREADS] [DATA_DIR] -> (model, global_batch, steps, threads, dir)."""
    threads = int(argv[4]) if len(argv) > 4 else max(1, (os.cpu_count() or 2) // 2)
    data_dir = argv[5] if len(argv) > 5 else "/usr/share/datasets/fashion-mnist"
    return argv[1], int(argv[2]), int(argv[3]), threads, data_dir


def make_torch_model(name, pool_first=False, need_weights=False):
    """The same layers as flotilla's models/zoo.cpp, in PyTorch (imported here, not at the top:
    the TensorFlow peer shares this module). pool_first: the CNN's "ReLU, max-pool 2" as
    "max-pool 2, ReLU", the same values (ReLU is monotone) with ReLU on a quarter of the
    elements; what flotilla's zoo computes (its MaxPool2ReLU), as a PyTorch user can write it.
    need_weights: ViT's attention asks nn.MultiheadAttention for the heads' averaged weights,
    which makes it compute softmax(Q K^T / sqrt(D)) V with bmm and softmax itself instead of
    through scaled_dot_product_attention (the same values)."""
    from torch import nn
    if name in ("mlp", "mlp-wide"):
        hidden = 256 if name == "mlp" else 2048
        return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(),
                             nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    if name == "cnn":
        def relu_pool():
            return [nn.MaxPool2d(2), nn.ReLU()] if pool_first else [nn.ReLU(), nn.MaxPool2d(2)]
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), *relu_pool(),
                             nn.Conv2d(32, 64, 3, padding=1), *relu_pool(),
                             nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Linear(128, 10))
    if name == "resnet20":
        return _torch_resnet((16, 32, 64), blocks=3)
    if name == "resnet18":
        return _torch_resnet((64, 128, 256, 512), blocks=2)
    if name == "vit-tiny":
        return _torch_vit(need_weights=need_weights)
    if name in ("tv-resnet18", "tv-mobilenetv2"):
        return torchvision_model(name)
    raise SystemExit(
        f"unknown model {name!r}; use mlp, mlp-wide, cnn, resnet20, resnet18, vit-tiny, "
        "tv-resnet18 or tv-mobilenetv2")


def torchvision_model(name):
    """Models nobody here wrote: torchvision's (bench/torchvision.sh puts the package on
    PYTHONPATH), made for 1x28x28 images as their users do for small images: ResNet-18 with a
    3x3 stride-1 stem of one input channel and no max-pool; MobileNetV2 with its first
    convolution of one input channel at stride 1. 10 classes."""
    import torchvision
    from torch import nn
    if name == "tv-resnet18":
        m = torchvision.models.resnet18(num_classes=10)
        m.conv1 = nn.Conv2d(1, 64, 3, stride=1, padding=1, bias=False)
        m.maxpool = nn.Identity()
        return m
    m = torchvision.models.mobilenet_v2(num_classes=10)
    m.features[0][0] = nn.Conv2d(1, 32, 3, stride=1, padding=1, bias=False)
    return m


def _torch_resnet(widths, blocks):
    """A ResNet of BasicBlocks for 28x28 images: a 3x3 stem (no max-pool), one stage per width
    (the first block of each later stage has stride 2), projection shortcuts (1x1 conv + BN)
    where the shape changes, global average pooling. (16, 32, 64) x 3 is He et al.'s CIFAR
    ResNet-20; (64, 128, 256, 512) x 2 is ResNet-18's layout."""
    from torch import nn

    def conv_bn(cin, cout, kernel, stride):
        return [nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False),
                nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1)]

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(*conv_bn(cin, cout, 3, stride), nn.ReLU(),
                                      *conv_bn(cout, cout, 3, 1))
            self.shortcut = (nn.Identity() if stride == 1 and cin == cout
                             else nn.Sequential(*conv_bn(cin, cout, 1, stride)))
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.body(x) + self.shortcut(x))

    layers, cin = [*conv_bn(1, widths[0], 3, 1), nn.ReLU()], widths[0]
    for stage, width in enumerate(widths):
        for block in range(blocks):
            layers.append(BasicBlock(cin, width, 2 if stage > 0 and block == 0 else 1))
            cin = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def _torch_vit(width=192, depth=6, heads=3, mlp=768, patch=4, dropout=0.1, need_weights=False):
    """ViT-Tiny's width, heads and MLP at depth 6 for 28x28 images: 4x4 patches (49 tokens) and
    a class token, pre-norm blocks, no dropout inside the attention, LayerNorm eps 1e-6 (set:
    torch's default is 1e-5, Keras' 1e-3)."""
    import torch
    from torch import nn

    class EncoderBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(width, eps=1e-6)
            self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
            self.drop = nn.Dropout(dropout)
            self.norm2 = nn.LayerNorm(width, eps=1e-6)
            self.mlp = nn.Sequential(nn.Linear(width, mlp), nn.GELU(), nn.Dropout(dropout),
                                     nn.Linear(mlp, width), nn.Dropout(dropout))

        def forward(self, x):
            h = self.norm1(x)
            # need_weights=False by default, as nn.TransformerEncoderLayer: no averaged weights
            # to build.
            x = x + self.drop(self.attention(h, h, h, need_weights=need_weights)[0])
            return x + self.mlp(self.norm2(x))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patches = nn.Conv2d(1, width, patch, stride=patch)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
            tokens = (28 // patch) ** 2 + 1
            self.position = nn.Parameter(nn.init.normal_(torch.empty(1, tokens, width), std=0.02))
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.Sequential(*[EncoderBlock() for _ in range(depth)])
            self.norm = nn.LayerNorm(width, eps=1e-6)
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            x = self.patches(x).flatten(2).transpose(1, 2)  # [N, 49, width]
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
            x = self.norm(self.blocks(self.drop(x + self.position)))
            return self.head(x[:, 0])

    return ViT()
