#include "models/zoo.h"

#include <torch/nn.h>

#include <algorithm>

#include "flotilla/error.h"
#include "flotilla/kernels/attention.h"
#include "flotilla/train/sync_batchnorm.h"

namespace flotilla::models {
namespace nn = torch::nn;

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> kNames = {"mlp",      "mlp-wide", "cnn",
                                                  "resnet20", "resnet18", "vit-tiny"};
  return kNames;
}

namespace {

nn::Sequential mlp(std::int64_t hidden) {
  return nn::Sequential(nn::Flatten(), nn::Linear(784, hidden), nn::ReLU(),
                        nn::Linear(hidden, hidden), nn::ReLU(), nn::Linear(hidden, 10));
}

// Plain layers; the compile step (flotilla/kernels/compile.h) makes the first convolution, its
// ReLU and max-pool one ConvMaxPool2ReLU, and the second "ReLU, max-pool 2" one MaxPool2ReLU,
// under these names: the weights are "0", "3", "7" and "9" as in PyTorch's twin. The layers are
// made last first, in the order GCC evaluated the arguments of the nn::Sequential(...) this was
// once, so the generator's draws give the same initial weights as every build before.
nn::Sequential cnn() {
  nn::Linear logits(128, 10), hidden(3136, 128);
  nn::Conv2d conv2(nn::Conv2dOptions(32, 64, 3).padding(1));
  nn::Conv2d conv1(nn::Conv2dOptions(1, 32, 3).padding(1));
  nn::Sequential net;
  net->push_back("0", conv1);
  net->push_back("1", nn::ReLU());
  net->push_back("2", nn::MaxPool2d(2));
  net->push_back("3", conv2);
  net->push_back("4", nn::ReLU());
  net->push_back("5", nn::MaxPool2d(2));
  net->push_back("6", nn::Flatten());
  net->push_back("7", hidden);
  net->push_back("8", nn::ReLU());
  net->push_back("9", logits);
  return net;
}

// ReLU(body(x) + shortcut(x)); no shortcut is the identity. A module of its own (not a
// Sequential) because of the sum, and ReplaceableChildren so convert_sync_batchnorm reaches the
// BatchNorms inside.
class ResidualImpl : public nn::Cloneable<ResidualImpl>, public train::ReplaceableChildren {
 public:
  ResidualImpl(nn::Sequential body, nn::Sequential shortcut)
      : body_(std::move(body)), shortcut_(std::move(shortcut)) {
    register_module("body", body_);
    if (shortcut_) register_module("shortcut", shortcut_);
  }
  // For clone(): the copy gets its own submodules (clone() then copies the values in).
  void reset() override {
    body_ = register_module("body", copy_of(body_));
    if (shortcut_) shortcut_ = register_module("shortcut", copy_of(shortcut_));
  }
  // Plain: the compile step swaps the body's layers (its 3x3 convolutions, its "BatchNorm,
  // ReLU") for flotilla's where they measure faster; the sum and the last ReLU stay ATen's.
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::relu(body_->forward(x) + (shortcut_ ? shortcut_->forward(x) : x));
  }
  void replace_child(const std::string& name,
                     const std::shared_ptr<nn::Module>& module) override {
    auto seq = std::dynamic_pointer_cast<nn::SequentialImpl>(module);
    if (!seq) throw ConfigError("Residual's \"" + name + "\" must stay a Sequential");
    (name == "body" ? body_ : shortcut_) = replace_module(name, nn::Sequential(seq));
  }

 private:
  static nn::Sequential copy_of(const nn::Sequential& m) {
    return nn::Sequential(std::dynamic_pointer_cast<nn::SequentialImpl>(m->clone()));
  }
  nn::Sequential body_;
  nn::Sequential shortcut_{nullptr};
};
TORCH_MODULE(Residual);

nn::Conv2d conv(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride) {
  return nn::Conv2d(
      nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// He et al.'s basic block: two 3×3 convs with BatchNorm; a 1×1 projection where the shape changes.
Residual basic_block(std::int64_t in, std::int64_t out, std::int64_t stride) {
  nn::Sequential body(conv(in, out, 3, stride), nn::BatchNorm2d(out), nn::ReLU(),
                      conv(out, out, 3, 1), nn::BatchNorm2d(out));
  nn::Sequential shortcut{nullptr};
  if (stride != 1 || in != out) shortcut = nn::Sequential(conv(in, out, 1, stride), nn::BatchNorm2d(out));
  return Residual(body, shortcut);
}

nn::Sequential resnet(std::int64_t stem, const std::vector<std::int64_t>& widths,
                      std::int64_t blocks_per_stage) {
  nn::Sequential net(conv(1, stem, 3, 1), nn::BatchNorm2d(stem), nn::ReLU());
  std::int64_t in = stem;
  for (std::size_t s = 0; s < widths.size(); ++s) {
    for (std::int64_t b = 0; b < blocks_per_stage; ++b) {
      net->push_back(basic_block(in, widths[s], s > 0 && b == 0 ? 2 : 1));
      in = widths[s];
    }
  }
  net->push_back(nn::AdaptiveAvgPool2d(1));
  net->push_back(nn::Flatten());
  net->push_back(nn::Linear(in, 10));
  return net;
}

constexpr std::int64_t kVitWidth = 192;
constexpr std::int64_t kVitHeads = 3;
constexpr double kVitDropout = 0.1;

// A Dropout in a Sequential of its own: the compile step can swap a Sequential's layers, not a
// module's members, and a Dropout has no tensors, so no name changes.
nn::Sequential dropout_layer() {
  return nn::Sequential(nn::Dropout(kVitDropout));
}
constexpr double kVitLayerNormEps = 1e-6;

nn::LayerNorm vit_layer_norm() {
  return nn::LayerNorm(nn::LayerNormOptions({kVitWidth}).eps(kVitLayerNormEps));
}

// Patches (a 4×4 stride-4 conv) to tokens, the class token first, plus position embeddings.
class PatchEmbeddingImpl : public nn::Cloneable<PatchEmbeddingImpl> {
 public:
  PatchEmbeddingImpl() { reset(); }
  void reset() override {
    projection_ =
        register_module("projection", nn::Conv2d(nn::Conv2dOptions(1, kVitWidth, 4).stride(4)));
    class_token_ = register_parameter("class_token", torch::zeros({1, 1, kVitWidth}));
    positions_ = register_parameter("position_embedding", torch::randn({1, 50, kVitWidth}) * 0.02);
    dropout_ = register_module("dropout", dropout_layer());
  }
  torch::Tensor forward(const torch::Tensor& images) {
    const torch::Tensor patches = projection_->forward(images).flatten(2).transpose(1, 2);
    // As PyTorch's twin: under autocast cat promotes to the class token's float32, so the
    // residual stream stays float32 and only the matmuls run in the lower precision.
    const torch::Tensor tokens =
        torch::cat({class_token_.expand({patches.size(0), 1, kVitWidth}), patches}, 1);
    return dropout_->forward(tokens + positions_);
  }

 private:
  nn::Conv2d projection_{nullptr};
  torch::Tensor class_token_, positions_;
  nn::Sequential dropout_{nullptr};
};
TORCH_MODULE(PatchEmbedding);

// Multi-head self-attention over [N, L, E] (kernels::attention: flotilla's or ATen's, whichever
// measured faster, as a user's module would call it), with PyTorch
// MultiheadAttention's parameters: one QKV projection, one output.
class SelfAttentionImpl : public nn::Cloneable<SelfAttentionImpl> {
 public:
  SelfAttentionImpl() { reset(); }
  void reset() override {
    qkv_ = register_module("qkv", nn::Linear(kVitWidth, 3 * kVitWidth));
    out_ = register_module("out", nn::Linear(kVitWidth, kVitWidth));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const std::int64_t n = x.size(0), l = x.size(1);
    const auto qkv =
        qkv_->forward(x).view({n, l, 3, kVitHeads, kVitWidth / kVitHeads}).permute({2, 0, 3, 1, 4});
    return out_->forward(kernels::attention(qkv[0], qkv[1], qkv[2])); // [N, L, E]
  }

 private:
  nn::Linear qkv_{nullptr}, out_{nullptr};
};
TORCH_MODULE(SelfAttention);

// x + attention(LN(x)); x + MLP(LN(x)).
class EncoderBlockImpl : public nn::Cloneable<EncoderBlockImpl> {
 public:
  EncoderBlockImpl() { reset(); }
  void reset() override {
    norm1_ = register_module("norm1", vit_layer_norm());
    attention_ = register_module("attention", SelfAttention());
    dropout_ = register_module("dropout", dropout_layer());
    norm2_ = register_module("norm2", vit_layer_norm());
    mlp_ = register_module(
        "mlp", nn::Sequential(nn::Linear(kVitWidth, 4 * kVitWidth),
                              nn::GELU(), nn::Dropout(kVitDropout),
                              nn::Linear(4 * kVitWidth, kVitWidth), nn::Dropout(kVitDropout)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor y = x + dropout_->forward(attention_->forward(norm1_->forward(x)));
    return y + mlp_->forward(norm2_->forward(y));
  }

 private:
  nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  SelfAttention attention_{nullptr};
  nn::Sequential dropout_{nullptr};
  nn::Sequential mlp_{nullptr};
};
TORCH_MODULE(EncoderBlock);

// The final LayerNorm, then the class token's logits.
class ClassTokenHeadImpl : public nn::Cloneable<ClassTokenHeadImpl> {
 public:
  ClassTokenHeadImpl() { reset(); }
  void reset() override {
    norm_ = register_module("norm", vit_layer_norm());
    linear_ = register_module("linear", nn::Linear(kVitWidth, 10));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    return linear_->forward(norm_->forward(tokens).select(1, 0));
  }

 private:
  nn::LayerNorm norm_{nullptr};
  nn::Linear linear_{nullptr};
};
TORCH_MODULE(ClassTokenHead);

nn::Sequential vit_tiny() {
  nn::Sequential net{PatchEmbedding()};
  for (int i = 0; i < 6; ++i) net->push_back(EncoderBlock());
  net->push_back(ClassTokenHead());
  return net;
}

} // namespace

nn::Sequential make_model(const std::string& name) {
  if (name == "mlp") return mlp(256);
  if (name == "mlp-wide") return mlp(2048);
  if (name == "cnn") return cnn();
  if (name == "resnet20") return resnet(16, {16, 32, 64}, 3);
  if (name == "resnet18") return resnet(64, {64, 128, 256, 512}, 2);
  if (name == "vit-tiny") return vit_tiny();
  std::string known;
  for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw ConfigError("model \"" + name + "\" is not built in; use one of: " + known);
}

} // namespace flotilla::models
