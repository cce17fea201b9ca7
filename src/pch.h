// Precompiled once per build: LibTorch's umbrella header dominates every translation unit's cost.
#pragma once
#include <torch/torch.h>
