// The compile step (flotilla/kernels/compile.h): what it swaps in a torch::nn tree and rewrites
// in a TorchScript graph made by the real torch (tests/fixtures/compile_models.py), what it
// leaves and says why, that the model's tensors and names stay the model's, and that the
// rewritten model computes what the original does.
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/torch.h>

#include <filesystem>

#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/compile.h"
#include "flotilla/kernels/conv_pool_relu.h"
#include "flotilla/kernels/dropout.h"
#include "flotilla/kernels/max_pool_relu.h"
#include "flotilla/kernels/modules.h"
#include "flotilla/kernels/winograd.h"
#include "flotilla/train/mixed_precision.h"
#include "kernel_choice.h"
#include "support/paths.h"
#include "support/subprocess.h"
#include "support/tensorboard.h"

namespace flotilla::kernels {
namespace {

namespace nn = torch::nn;
namespace fs = std::filesystem;
const auto kChannelsLast = torch::MemoryFormat::ChannelsLast;

// A module whose forward calls its members: nothing can swap them.
class MembersImpl : public nn::Cloneable<MembersImpl> {
 public:
  MembersImpl() { reset(); }
  void reset() override {
    conv = register_module("conv", nn::Conv2d(nn::Conv2dOptions(32, 32, 3).padding(1).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return conv->forward(x); }
  nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Members);

// A block of the user's own around a Sequential (as a residual block holds its body).
class BlockImpl : public nn::Cloneable<BlockImpl> {
 public:
  explicit BlockImpl(nn::Sequential body) : body(std::move(body)) { register_module("body", this->body); }
  void reset() override {
    body = register_module("body", nn::Sequential(std::dynamic_pointer_cast<nn::SequentialImpl>(body->clone())));
  }
  torch::Tensor forward(const torch::Tensor& x) { return body->forward(x); }
  nn::Sequential body;
};
TORCH_MODULE(Block);

nn::Sequential net() {
  torch::manual_seed(3);
  nn::Sequential body(nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1).bias(false)),
                      nn::BatchNorm2d(32), nn::ReLU(), Members(), nn::BatchNorm2d(32), nn::ReLU6(),
                      nn::Conv2d(nn::Conv2dOptions(32, 32, 3).padding(1).stride(2).bias(false)),
                      nn::BatchNorm2d(32));
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1)), nn::ReLU(),
                        nn::MaxPool2d(2), Block(body), nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(),
                        nn::Linear(32 * 3 * 3, 64), nn::GELU(), nn::Dropout(0.25),
                        nn::Linear(64, 10), nn::Dropout(0.5));
}

std::map<std::string, const c10::TensorImpl*> tensors_of(const nn::Module& m) {
  std::map<std::string, const c10::TensorImpl*> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().unsafeGetTensorImpl();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().unsafeGetTensorImpl();
  return out;
}

template <class T> bool is(const std::shared_ptr<nn::Module>& m) {
  return dynamic_cast<T*>(m.get()) != nullptr;
}

TEST(Compile, SwapsASequentialsLayersAndKeepsTheModelsTensorsAndNames) {
  KernelMode fixed(Mode::kFixed);
  nn::Sequential model = net();
  auto original = std::dynamic_pointer_cast<nn::SequentialImpl>(model->clone());
  const auto before = tensors_of(*model);
  const CompileReport report = compile(*model);
  EXPECT_EQ(tensors_of(*model), before); // the same tensors under the same names

  EXPECT_EQ(report.rewritten.at("first layers (Conv2d, ReLU, MaxPool2d)"), 1);
  EXPECT_EQ(report.rewritten.at("3x3 convolutions"), 1);
  EXPECT_EQ(report.rewritten.at("BatchNorm+ReLU"), 1);
  EXPECT_EQ(report.rewritten.at("BatchNorm+ReLU6"), 1);
  EXPECT_EQ(report.rewritten.at("ReLU+MaxPool2d"), 1);
  EXPECT_EQ(report.rewritten.at("GELU+Dropout"), 1);
  EXPECT_EQ(report.rewritten.at("Dropout"), 1);
  EXPECT_EQ(report.left.at("Conv2d (stride 2)"), 1);
  EXPECT_EQ(report.left.at("Conv2d (outside a Sequential)"), 1);
  EXPECT_EQ(report.left.at("BatchNorm2d (not followed by ReLU)"), 1);
  EXPECT_NE(report.summary().find("left to ATen: 1 BatchNorm2d (not followed by ReLU)"),
            std::string::npos)
      << report.summary();

  EXPECT_TRUE(is<ConvMaxPool2ReLUImpl>(model->ptr(0)));
  EXPECT_TRUE(is<nn::IdentityImpl>(model->ptr(1)));
  EXPECT_TRUE(is<nn::IdentityImpl>(model->ptr(2)));
  const auto body = model->ptr<BlockImpl>(3)->body;
  EXPECT_TRUE(is<Conv2dImpl>(body->ptr(0)));
  EXPECT_TRUE(is<BatchNormReLUImpl>(body->ptr(1)));
  EXPECT_TRUE(is<nn::IdentityImpl>(body->ptr(2)));
  EXPECT_TRUE(is<BatchNormReLUImpl>(body->ptr(4)));
  EXPECT_TRUE(is<nn::Conv2dImpl>(body->ptr(6)));
  EXPECT_TRUE(is<MaxPool2ReLUImpl>(model->ptr(4)));
  EXPECT_TRUE(is<GeluDropoutImpl>(model->ptr(8)));
  EXPECT_TRUE(is<DropoutImpl>(model->ptr(11)));

  // The same values, in evaluation (dropout off) and channels-last as compile() keeps a
  // convolutional net: within float rounding (Winograd's, the fused BatchNorm's sums).
  model->eval();
  original->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({8, 1, 24, 24}).contiguous(kChannelsLast);
  for (auto* m : {static_cast<nn::Module*>(model.get()), static_cast<nn::Module*>(original.get())}) {
    for (auto& p : m->parameters()) {
      if (p.dim() == 4) p.set_data(p.contiguous(kChannelsLast));
    }
  }
  const torch::Tensor y = model->forward(x), expected = original->forward(x);
  EXPECT_LT(relative_difference(y, expected), 1e-5);
  EXPECT_FALSE(torch::equal(y, expected)) << "flotilla's kernels ran";

  // A copy for another replica has tensors of its own with the same values.
  auto copy = std::dynamic_pointer_cast<nn::SequentialImpl>(model->clone());
  const auto copied = copy->named_parameters();
  for (const auto& p : model->named_parameters()) {
    EXPECT_NE(copied[p.key()].unsafeGetTensorImpl(), p.value().unsafeGetTensorImpl()) << p.key();
    EXPECT_TRUE(torch::equal(copied[p.key()], p.value())) << p.key();
  }
  EXPECT_TRUE(torch::equal(copy->forward(x), y));
}

TEST(Compile, TrainingThroughTheSwappedLayersGivesTheOriginalsGradients) {
  KernelMode fixed(Mode::kFixed);
  nn::Sequential model = net();
  auto original = std::dynamic_pointer_cast<nn::SequentialImpl>(model->clone());
  compile(*model);
  const torch::Tensor x = torch::randn({8, 1, 24, 24});
  // Without the Dropouts' draws: p = 0 leaves the masks out of the comparison.
  for (auto* m : {model.get(), original.get()}) {
    for (const auto& sub : m->modules()) {
      if (auto* d = dynamic_cast<nn::DropoutImpl*>(sub.get())) d->options.p(0);
      if (auto* d = dynamic_cast<DropoutImpl*>(sub.get())) d->p = 0;
      if (auto* d = dynamic_cast<GeluDropoutImpl*>(sub.get())) d->p = 0;
    }
  }
  model->forward(x).square().sum().backward();
  original->forward(x).square().sum().backward();
  const auto expected = original->named_parameters();
  for (const auto& p : model->named_parameters()) {
    EXPECT_LT(relative_difference(p.value().grad(), expected[p.key()].grad()), 1e-4) << p.key();
  }
  const auto running = original->named_buffers();
  for (const auto& b : model->named_buffers()) {
    EXPECT_LT(relative_difference(b.value().to(torch::kDouble), running[b.key()].to(torch::kDouble)),
              1e-5)
        << b.key();
  }
}

// For a model that trains under bfloat16 autocast every other Conv2d of zero padding (here the
// stride-2 one) is swapped too, to compute in float32 (convolution.h); a step then runs it.
TEST(Compile, UnderBfloat16EveryOtherConvolutionIsSwappedToo) {
  KernelMode fixed(Mode::kFixed);
  nn::Sequential model = net();
  const auto before = tensors_of(*model);
  const CompileReport report = compile(*model, /*bfloat16=*/true);
  EXPECT_EQ(tensors_of(*model), before);
  EXPECT_EQ(report.rewritten.at("3x3 convolutions"), 1) << report.summary();
  EXPECT_EQ(report.rewritten.at("other convolutions (bfloat16 in float32 arithmetic)"), 1)
      << report.summary();
  EXPECT_EQ(report.left.count("Conv2d (stride 2)"), 0u) << report.summary();
  EXPECT_EQ(report.left.at("Conv2d (outside a Sequential)"), 1) << report.summary();
  const auto body = model->ptr<BlockImpl>(3)->body;
  EXPECT_TRUE(is<Conv2dImpl>(body->ptr(6)));
  set_cache_directory(fs::path());
  reset_decisions();
  {
    train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
    model->forward(torch::randn({4, 1, 24, 24}).contiguous(kChannelsLast)).sum().backward();
  }
  bool ran = false;
  for (const Decision& d : decisions()) ran |= d.op == "conv_float32" && d.flotilla;
  EXPECT_TRUE(ran);
  EXPECT_TRUE(body->ptr<Conv2dImpl>(6)->weight.grad().defined());
  reset_decisions();
  set_cache_directory(std::nullopt);
}

TEST(Compile, UnderModeNoneNothingChanges) {
  KernelMode none(Mode::kNone);
  nn::Sequential model = net();
  const CompileReport report = compile(*model);
  EXPECT_TRUE(report.rewritten.empty());
  EXPECT_TRUE(is<nn::Conv2dImpl>(model->ptr(0)));
}

class CompileScript : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    const auto r = testing::run_process(
        {testing::test_python(), testing::source_dir() + "/tests/fixtures/compile_models.py",
         "make", dir_->path()});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static torch::jit::Module load(const std::string& name) {
    return torch::jit::load((fs::path(dir_->path()) / name).string());
  }
  static testing::TempDir* dir_;
};
testing::TempDir* CompileScript::dir_ = nullptr;

// torchvision's BasicBlock, scripted: its two 3x3 convolutions become flotilla::conv2d, the
// stem's and bn1's BatchNorm+ReLU and bn2's "+= identity, ReLU" flotilla::batch_norm_relu; the
// stem's one-channel and the stride-2 convolutions are left, and said why.
TEST_F(CompileScript, RewritesAScriptedResNetBlock) {
  KernelMode fixed(Mode::kFixed);
  torch::jit::Module original = load("block.pt");
  CompileReport report;
  torch::jit::Module compiled = compile(original, report);
  EXPECT_EQ(report.rewritten.at("3x3 convolutions"), 2) << report.summary();
  EXPECT_EQ(report.rewritten.at("batch_norm+relu"), 2) << report.summary();
  EXPECT_EQ(report.rewritten.at("batch_norm+add+relu"), 1) << report.summary();
  EXPECT_EQ(report.left.at("convolutions (stride not 1)"), 1) << report.summary();
  EXPECT_EQ(report.left.at("convolutions (channels not multiples of 16 up to 512)"), 1)
      << report.summary();
  const std::string graph = compiled.get_method("forward").graph()->toString();
  EXPECT_EQ(graph.find("aten::batch_norm"), std::string::npos) << graph;
  EXPECT_NE(graph.find("flotilla::conv2d"), std::string::npos) << graph;
  // The original is untouched, and both hold the same tensors.
  EXPECT_NE(original.get_method("forward").graph()->toString().find("prim::CallMethod"),
            std::string::npos);
  const auto a = original.named_parameters(), b = compiled.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (auto i = a.begin(), j = b.begin(); i != a.end(); ++i, ++j) {
    EXPECT_EQ((*i).name, (*j).name);
    EXPECT_EQ((*i).value.unsafeGetTensorImpl(), (*j).value.unsafeGetTensorImpl()) << (*i).name;
  }
}

// A training step of the rewritten module against the original's: the same loss, gradients and
// running statistics within float rounding, and flotilla's kernels ran (not ATen's to the bit).
TEST_F(CompileScript, TheRewrittenBlockTrainsAsTheOriginal) {
  KernelMode fixed(Mode::kFixed);
  torch::manual_seed(9);
  const torch::Tensor x = torch::randn({6, 1, 12, 12}).contiguous(kChannelsLast);
  std::vector<std::map<std::string, torch::Tensor>> results;
  for (const bool rewrite : {false, true}) {
    torch::jit::Module m = load("block.pt");
    for (const auto& p : m.parameters()) {
      if (p.dim() == 4) p.set_data(p.contiguous(kChannelsLast));
    }
    CompileReport report;
    if (rewrite) m = compile(m, report);
    m.train();
    const torch::Tensor y = m.forward({x}).toTensor();
    y.square().sum().backward();
    std::map<std::string, torch::Tensor> r = {{"y", y.detach()}};
    for (const auto& p : m.named_parameters()) r["grad " + p.name] = p.value.grad();
    for (const auto& b : m.named_buffers()) r[b.name] = b.value.to(torch::kDouble);
    results.push_back(r);
  }
  EXPECT_FALSE(torch::equal(results[1]["y"], results[0]["y"]));
  for (const auto& [name, value] : results[0]) {
    EXPECT_LT(relative_difference(results[1].at(name), value), 1e-4) << name;
  }
}

// MobileNetV2's inverted residual: each "BatchNorm, ReLU6" as flotilla::batch_norm_relu with a
// ceiling of 6, the rest left and said why; and it trains as the original.
TEST_F(CompileScript, RewritesMobileNetsBatchNormAndReLU6) {
  KernelMode fixed(Mode::kFixed);
  torch::jit::Module original = load("inverted.pt");
  CompileReport report;
  torch::jit::Module compiled = compile(original, report);
  EXPECT_EQ(report.rewritten.at("batch_norm+relu6"), 2) << report.summary();
  EXPECT_EQ(report.left.at("convolutions (grouped)"), 1) << report.summary();
  EXPECT_EQ(report.left.at("batch_norm (not followed by relu or relu6)"), 1) << report.summary();
  const torch::Tensor x = torch::randn({4, 1, 10, 10}).contiguous(kChannelsLast) * 3;
  std::vector<std::map<std::string, torch::Tensor>> results;
  for (auto* m : {&original, &compiled}) {
    m->train();
    const torch::Tensor y = m->forward({x}).toTensor();
    y.square().sum().backward();
    std::map<std::string, torch::Tensor> r = {{"y", y.detach()}};
    for (const auto& p : m->named_parameters()) {
      r["grad " + p.name] = p.value.grad().clone();
      p.value.mutable_grad().reset();
    }
    results.push_back(r);
  }
  for (const auto& [name, value] : results[0]) {
    EXPECT_LT(relative_difference(results[1].at(name), value), 1e-4) << name;
  }
}

// Under bfloat16 the inverted residual's other convolutions (the one-channel stem, the 1x1s and
// the depthwise 3x3) become flotilla::conv2d too, and a bfloat16 step trains as oneDNN's does:
// the loss within bfloat16's rounding, the gradients as close to the float32 step's.
TEST_F(CompileScript, UnderBfloat16MobileNetsOtherConvolutionsAreRewritten) {
  KernelMode fixed(Mode::kFixed);
  torch::jit::Module original = load("inverted.pt");
  CompileReport report;
  torch::jit::Module compiled = compile(original, report, /*bfloat16=*/true);
  EXPECT_EQ(report.rewritten.at("other convolutions (bfloat16 in float32 arithmetic)"), 4)
      << report.summary();
  for (const auto& [why, n] : report.left) {
    EXPECT_NE(why.rfind("convolutions", 0), 0u) << n << " " << why << " left: " << report.summary();
  }
  torch::manual_seed(12);
  const torch::Tensor x = torch::randn({8, 1, 10, 10}).contiguous(kChannelsLast);
  std::vector<std::pair<torch::Tensor, std::map<std::string, torch::Tensor>>> results;
  // oneDNN's bfloat16 step, flotilla's, and the float32 step.
  for (auto* m : {&original, &compiled, &original}) {
    m->train();
    const bool in_float32 = results.size() == 2;
    torch::Tensor loss;
    {
      train::AutocastGuard autocast(
          in_float32 ? train::Policy::kFloat32 : train::Policy::kMixedBFloat16, torch::kCPU);
      loss = m->forward({x}).toTensor().to(torch::kFloat).square().mean();
    }
    loss.backward();
    std::map<std::string, torch::Tensor> grads;
    for (const auto& p : m->named_parameters()) {
      grads[p.name] = p.value.grad().clone();
      p.value.mutable_grad().reset();
    }
    results.emplace_back(loss.detach(), grads);
  }
  EXPECT_FALSE(torch::equal(results[0].first, results[1].first)) << "flotilla's path ran";
  EXPECT_LT(relative_difference(results[1].first, results[0].first), 1.0 / 64);
  // Against the float32 step's gradient: pointing the same way (cosine above 0.99), or where
  // bfloat16's rounding swamps a gradient near zero (a BatchNorm weight's, 3e-7 long here) no
  // farther off than oneDNN's bfloat16 step.
  for (const auto& [name, g] : results[2].second) {
    const torch::Tensor truth = g.flatten().to(torch::kDouble);
    const auto cosine = [&](const torch::Tensor& a) {
      return torch::cosine_similarity(a.flatten().to(torch::kDouble), truth, 0).item<double>();
    };
    const double ours = cosine(results[1].second.at(name));
    const double onednn = cosine(results[0].second.at(name));
    EXPECT_GT(ours, std::min(0.99, onednn - 0.01)) << name << ": oneDNN's " << onednn;
  }
}

TEST_F(CompileScript, RewritesATrace) {
  KernelMode fixed(Mode::kFixed);
  torch::jit::Module traced = load("block_traced.pt");
  CompileReport report;
  torch::jit::Module compiled = compile(traced, report);
  EXPECT_EQ(report.rewritten.at("3x3 convolutions"), 2) << report.summary();
  EXPECT_EQ(report.rewritten.at("batch_norm+add+relu"), 1) << report.summary();
  traced.eval();
  compiled.eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({3, 1, 12, 12}).contiguous(kChannelsLast);
  const torch::Tensor y = compiled.forward({x}).toTensor();
  EXPECT_LT(relative_difference(y, traced.forward({x}).toTensor()), 1e-5);
}

} // namespace
} // namespace flotilla::kernels
