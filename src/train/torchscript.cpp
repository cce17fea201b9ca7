#include "flotilla/train/torchscript.h"

#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>

#include <filesystem>
#include <sstream>

#include "flotilla/error.h"

namespace flotilla::train {
namespace {

// torch's message in one line: a TorchScript interpreter error ends with the Python-style
// "RuntimeError: ..." line that says what failed; others say it on their first line.
std::string one_line(const std::string& text) {
  std::istringstream in(text);
  std::string line, first, last;
  while (std::getline(in, line)) {
    const auto begin = line.find_first_not_of(" \t");
    if (begin == std::string::npos) continue;
    line = line.substr(begin);
    if (first.empty()) first = line;
    last = line;
  }
  return text.find("Traceback of TorchScript") != std::string::npos ? last : first;
}

std::string shape_of(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes() << " " << c10::toString(t.scalar_type());
  return out.str();
}

// Names in a torch::nn::Module may not hold dots; a TorchScript module's never do (they are
// attribute names), but say so rather than fail inside register_parameter.
void mirror(torch::nn::Module& into, const torch::jit::Module& from, const std::string& source) {
  for (const auto& p : from.named_parameters(/*recurse=*/false)) {
    if (!p.value.defined()) continue;
    into.register_parameter(p.name, p.value, p.value.requires_grad());
  }
  for (const auto& b : from.named_buffers(/*recurse=*/false)) {
    if (!b.value.defined()) continue;
    into.register_buffer(b.name, b.value);
  }
  for (const auto& child : from.named_children()) {
    if (child.name.find('.') != std::string::npos) {
      throw ConfigError(source + ": submodule name \"" + child.name + "\" holds a dot");
    }
    auto holder = std::make_shared<torch::nn::Module>(child.name);
    mirror(*holder, child.value, source);
    into.register_module(child.name, holder);
  }
}

} // namespace

TorchScriptModuleImpl::TorchScriptModuleImpl(torch::jit::Module module, std::string source)
    : torch::nn::Module("TorchScriptModule"), script_(std::move(module)),
      source_(source.empty() ? "TorchScript module" : std::move(source)) {
  const auto method = script_.find_method("forward");
  if (!method) throw ConfigError(source_ + " has no forward method; script or trace an nn.Module");
  // self plus one input; further arguments only with defaults.
  const auto& args = method->function().getSchema().arguments();
  std::size_t required = 0;
  for (std::size_t i = 1; i < args.size(); ++i) required += args[i].default_value() ? 0 : 1;
  if (args.size() < 2 || required > 1) {
    std::ostringstream schema;
    schema << method->function().getSchema();
    throw ConfigError(source_ + ": forward is " + schema.str() +
                      "; flotilla trains a forward of one tensor (a batch) to one tensor (its "
                      "outputs)");
  }
  mirror(*this, script_, source_);
  script_.train(is_training());
}

torch::Tensor TorchScriptModuleImpl::forward(const torch::Tensor& x) {
  // Op by op, as eager PyTorch (thread-local; restored on return).
  torch::jit::GraphOptimizerEnabledGuard eager(false);
  c10::IValue out = script_.forward({x});
  if (!out.isTensor()) {
    throw ConfigError(source_ + ": forward returned " + out.tagKind() +
                      ", not a tensor; flotilla trains a forward of one tensor to one tensor "
                      "(return the logits alone)");
  }
  return out.toTensor();
}

void TorchScriptModuleImpl::train(bool on) {
  torch::nn::Module::train(on);
  script_.train(on);
}

std::shared_ptr<torch::nn::Module>
TorchScriptModuleImpl::clone(const std::optional<torch::Device>& device) const {
  auto copy = std::make_shared<TorchScriptModuleImpl>(script_.deepcopy(), source_);
  copy->train(is_training());
  if (device) copy->to(*device);
  return copy;
}

TorchScriptModule load_torchscript(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw ConfigError(path + ": no such file; give the path of a module saved with "
                             "torch.jit.save (torch.jit.script(model).save(\"model.pt\"))");
  }
  torch::jit::Module module;
  try {
    module = torch::jit::load(path, torch::kCPU);
  } catch (const c10::Error& e) {
    throw ConfigError(path + " is not a TorchScript module (" + one_line(e.what_without_backtrace()) +
                      "); save one in Python with torch.jit.script(model).save(\"model.pt\")");
  }
  return TorchScriptModule(std::move(module), path);
}

torch::Tensor check_forward(TorchScriptModule& module, const torch::Tensor& sample) {
  // In the mode training will run it, but leaving no trace: BatchNorm's running statistics
  // (a forward in training mode updates them) are put back as they were.
  torch::NoGradGuard no_grad;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
  for (const auto& b : module->buffers()) buffers.emplace_back(b, b.clone());
  const bool training = module->is_training();
  auto restore = [&] {
    for (auto& [buffer, saved] : buffers) buffer.copy_(saved);
    module->train(training);
  };
  module->train(true);
  torch::Tensor out;
  try {
    out = module->forward(sample);
  } catch (const Error&) { // flotilla's own (a forward that returns no tensor): as it is
    restore();
    throw;
  } catch (const std::exception& e) { // torch's: c10::Error, or the interpreter's JITException
    restore();
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    throw ConfigError(module->source() + ": forward failed on a batch of shape " +
                      shape_of(sample) + ": " +
                      one_line(c10 ? c10->what_without_backtrace() : e.what()));
  }
  restore();
  return out;
}

} // namespace flotilla::train
