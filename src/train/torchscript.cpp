#include "flotilla/train/torchscript.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/library.h>

#include <filesystem>
#include <functional>
#include <set>
#include <sstream>

#include "flotilla/error.h"
#include "flotilla/log.h"
#include "train/sync_batchnorm_core.h"

namespace flotilla::train {
namespace {

// --- flotilla::sync_batch_norm: aten::batch_norm's schema, SyncBatchNorm's computation ---

// The replica context of the TorchScript module running on this thread, in training, when its
// BatchNorms are synchronised (set by TorchScriptModuleImpl::forward for the call).
thread_local const strategy::ReplicaContext* t_sync_context = nullptr;

at::Tensor sync_batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var, bool training,
                           double momentum, double eps, bool cudnn_enabled) {
  if (!training || t_sync_context == nullptr) {
    return at::batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps,
                          cudnn_enabled);
  }
  auto get = [](const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); };
  return detail::global_batch_norm(input, get(weight), get(bias), get(running_mean),
                                   get(running_var), [momentum] { return momentum; }, eps,
                                   *t_sync_context);
}

TORCH_LIBRARY(flotilla, m) {
  m.def("sync_batch_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
        "Tensor? running_var, bool training, float momentum, float eps, bool cudnn_enabled) -> "
        "Tensor");
}
// Above autograd: the computation records its own backward node.
TORCH_LIBRARY_IMPL(flotilla, CompositeImplicitAutograd, m) {
  m.impl("sync_batch_norm", TORCH_FN(sync_batch_norm));
}

// Every aten::batch_norm node in `function`'s graph (its blocks included) and in the functions it
// calls (a scripted BatchNorm calls F.batch_norm through prim::CallFunction; a trace holds the
// node itself). `seen`: functions already searched (the compiled types are shared).
void find_batch_norms(torch::jit::Function& function, std::set<const torch::jit::Function*>& seen,
                      std::vector<torch::jit::Node*>& found) {
  if (!seen.insert(&function).second || !function.isGraphFunction()) return;
  static const auto batch_norm = c10::Symbol::fromQualString("aten::batch_norm");
  std::function<void(torch::jit::Block*)> visit = [&](torch::jit::Block* block) {
    for (torch::jit::Node* node : block->nodes()) {
      if (node->kind() == batch_norm) found.push_back(node);
      if (node->kind() == torch::jit::prim::CallFunction) {
        if (auto callee = node->input(0)->type()->cast<c10::FunctionType>()) {
          find_batch_norms(*callee->function(), seen, found);
        }
      }
      for (torch::jit::Block* inner : node->blocks()) visit(inner);
    }
  };
  visit(torch::jit::toGraphFunction(function).graph()->block());
}

std::vector<torch::jit::Node*> batch_norms_of(const torch::jit::Module& script) {
  std::set<const torch::jit::Function*> seen;
  std::vector<torch::jit::Node*> found;
  for (const torch::jit::Module& m : script.modules()) {
    for (const torch::jit::Method& method : m.get_methods()) {
      find_batch_norms(method.function(), seen, found);
    }
  }
  return found;
}

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
// A tensor held under two names (tied weights) is registered under the first only: the optimizer
// and the gradient engine must see it once.
void mirror(torch::nn::Module& into, const torch::jit::Module& from, const std::string& source,
            std::set<const c10::TensorImpl*>& seen) {
  for (const auto& p : from.named_parameters(/*recurse=*/false)) {
    if (!p.value.defined() || !seen.insert(p.value.unsafeGetTensorImpl()).second) continue;
    into.register_parameter(p.name, p.value, p.value.requires_grad());
  }
  for (const auto& b : from.named_buffers(/*recurse=*/false)) {
    if (!b.value.defined() || !seen.insert(b.value.unsafeGetTensorImpl()).second) continue;
    into.register_buffer(b.name, b.value);
  }
  for (const auto& child : from.named_children()) {
    if (child.name.find('.') != std::string::npos) {
      throw ConfigError(source + ": submodule name \"" + child.name + "\" holds a dot");
    }
    auto holder = std::make_shared<torch::nn::Module>(child.name);
    mirror(*holder, child.value, source, seen);
    into.register_module(child.name, holder);
  }
}

} // namespace

TorchScriptModuleImpl::TorchScriptModuleImpl(torch::jit::Module module, std::string source)
    : torch::nn::Module("TorchScriptModule"), script_(std::move(module)),
      source_(source.empty() ? "TorchScript module" : std::move(source)) {
  const auto method = script_.find_method("forward");
  if (!method) throw ConfigError(source_ + " has no forward method; script or trace an nn.Module");
  // self plus the inputs; further arguments only with defaults.
  const auto& args = method->function().getSchema().arguments();
  std::size_t required = 0;
  for (std::size_t i = 1; i < args.size(); ++i) required += args[i].default_value() ? 0 : 1;
  if (args.size() < 2) {
    std::ostringstream schema;
    schema << method->function().getSchema();
    throw ConfigError(source_ + ": forward is " + schema.str() +
                      "; flotilla trains a forward of one tensor (a batch) or several");
  }
  inputs_ = static_cast<int>(std::max<std::size_t>(required, 1));
  std::set<const c10::TensorImpl*> seen;
  mirror(*this, script_, source_, seen);
  script_.train(is_training());
}

bool TorchScriptModuleImpl::traced_in_training_mode() const {
  for (torch::jit::Node* node : batch_norms_of(script_)) {
    const auto training = torch::jit::toIValue(node->input(5)); // a constant only in a trace
    if (training && training->isBool() && training->toBool()) return true;
  }
  return false;
}

int TorchScriptModuleImpl::convert_sync_batchnorm() {
  if (has_run_) {
    throw ConfigError(source_ + ": convert_sync_batchnorm() after its first forward, when its "
                                "graphs are compiled; convert it right after loading");
  }
  if (sync_layers_ > 0) return sync_layers_;
  // Each node becomes flotilla::sync_batch_norm: the same inputs, the same output.
  static const auto sync = c10::Symbol::fromQualString("flotilla::sync_batch_norm");
  const std::vector<torch::jit::Node*> calls = batch_norms_of(script_);
  for (torch::jit::Node* node : calls) {
    torch::jit::Graph& graph = *node->owningGraph();
    torch::jit::WithInsertPoint here(node);
    torch::jit::Node* replacement = graph.insertNode(graph.create(sync, node->inputs(), 1));
    replacement->output()->setType(node->output()->type());
    node->output()->replaceAllUsesWith(replacement->output());
    node->destroy();
  }
  int layers = 0;
  for (const torch::jit::Module& m : script_.modules()) {
    const std::string type = m.type()->name() ? m.type()->name()->name() : "";
    layers += type == "BatchNorm1d" || type == "BatchNorm2d" || type == "BatchNorm3d";
  }
  sync_layers_ = calls.empty() ? 0 : layers > 0 ? layers : static_cast<int>(calls.size());
  return sync_layers_;
}

kernels::CompileReport TorchScriptModuleImpl::compile_kernels(bool bfloat16) {
  kernels::CompileReport report;
  script_ = kernels::compile(script_, report, bfloat16);
  script_.train(is_training());
  return report;
}

torch::Tensor TorchScriptModuleImpl::forward(const torch::Tensor& x) {
  if (inputs_ != 1) {
    throw ConfigError(source_ + ": forward takes " + std::to_string(inputs_) +
                      " inputs; give the Model torchscript_forward() and a Signature of " +
                      std::to_string(inputs_) + " inputs");
  }
  c10::IValue out = run({x});
  if (!out.isTensor()) {
    throw ConfigError(source_ + ": forward returned " + out.tagKind() +
                      ", not a tensor; flotilla trains a forward of one tensor to one tensor "
                      "(return the logits alone), or give the Model torchscript_forward() and a "
                      "Signature of several outputs");
  }
  return out.toTensor();
}

Tensors TorchScriptModuleImpl::forward_all(const Tensors& inputs) {
  if (static_cast<int>(inputs.size()) != inputs_) {
    throw ConfigError(source_ + ": forward takes " + std::to_string(inputs_) + " inputs; saw " +
                      std::to_string(inputs.size()));
  }
  const c10::IValue out = run(std::vector<c10::IValue>(inputs.begin(), inputs.end()));
  Tensors outputs;
  const auto add = [&](const c10::IValue& v) {
    if (!v.isTensor()) {
      throw ConfigError(source_ + ": forward returned " + out.tagKind() + " holding " +
                        v.tagKind() + "; flotilla trains outputs that are tensors");
    }
    outputs.push_back(v.toTensor());
  };
  if (out.isTuple()) {
    for (const auto& v : out.toTupleRef().elements()) add(v);
  } else if (out.isList()) {
    for (const auto& v : out.toListRef()) add(v);
  } else if (out.isGenericDict()) {
    for (const auto& item : out.toGenericDict()) add(item.value());
  } else {
    add(out);
  }
  return outputs;
}

c10::IValue TorchScriptModuleImpl::run(std::vector<c10::IValue> inputs) {
  has_run_ = true;
  // Op by op, as eager PyTorch (thread-local; restored on return).
  torch::jit::GraphOptimizerEnabledGuard eager(false);
  // The synchronised BatchNorms meet the other replicas through this copy's context.
  struct SyncScope {
    const strategy::ReplicaContext* before = t_sync_context;
    explicit SyncScope(const strategy::ReplicaContext* c) { t_sync_context = c; }
    ~SyncScope() { t_sync_context = before; }
  } scope(sync_layers_ > 0 && is_training() ? &context_ : nullptr);
  return script_.forward(std::move(inputs));
}

Model::MultiForward torchscript_forward(const TorchScriptModule& module) {
  return [impl = module.ptr()](const Tensors& inputs) { return impl->forward_all(inputs); };
}

std::function<Model::MultiReplica()> torchscript_clone(const TorchScriptModule& module) {
  return [impl = module.ptr()]() -> Model::MultiReplica {
    auto copy = std::dynamic_pointer_cast<TorchScriptModuleImpl>(impl->clone());
    return {copy, torchscript_forward(TorchScriptModule(copy))};
  };
}

void TorchScriptModuleImpl::train(bool on) {
  torch::nn::Module::train(on);
  script_.train(on);
}

std::shared_ptr<torch::nn::Module>
TorchScriptModuleImpl::clone(const std::optional<torch::Device>& device) const {
  // Copied as leaves (a clone under autograd would hang off the original's graph), each
  // parameter as trainable as the original's.
  torch::jit::Module copied;
  {
    torch::NoGradGuard no_grad;
    copied = script_.deepcopy();
  }
  std::vector<bool> trainable;
  for (const auto& p : script_.parameters()) trainable.push_back(p.requires_grad());
  std::size_t k = 0;
  for (const auto& p : copied.parameters()) p.set_requires_grad(trainable.at(k++));
  auto copy = std::make_shared<TorchScriptModuleImpl>(std::move(copied), source_);
  copy->sync_layers_ = sync_layers_; // the same (shared, rewritten) compiled graphs
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
  TorchScriptModule loaded(std::move(module), path);
  if (loaded->traced_in_training_mode()) {
    Logger().warn(path + " was traced in training mode: its batch_norm calls use batch statistics "
                         "in evaluation too (a trace records the mode as a constant); script it "
                         "(torch.jit.script), or trace it after model.eval() for inference");
  }
  return loaded;
}

torch::Tensor check_forward(TorchScriptModule& module, const torch::Tensor& sample) {
  // In the mode training will run it, but leaving no trace: BatchNorm's running statistics
  // (a forward in training mode updates them) and the mode are put back as they were.
  torch::NoGradGuard no_grad;
  struct Restore {
    TorchScriptModule& module;
    bool training = module->is_training();
    std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
    ~Restore() {
      for (auto& [buffer, saved] : buffers) buffer.copy_(saved);
      module->train(training);
    }
  } restore{module};
  for (const auto& b : module->buffers()) restore.buffers.emplace_back(b, b.clone());
  module->train(true);
  try {
    return module->forward(sample);
  } catch (const Error&) { // flotilla's own (a forward that returns no tensor): as it is
    throw;
  } catch (const std::exception& e) { // torch's: c10::Error, or the interpreter's JITException
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    throw ConfigError(module->source() + ": forward failed on a batch of shape " +
                      shape_of(sample) + ": " +
                      one_line(c10 ? c10->what_without_backtrace() : e.what()));
  }
}

} // namespace flotilla::train
