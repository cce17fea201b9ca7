// Models defined in Python: a TorchScript module (torch.jit.script or torch.jit.trace, saved with
// torch.jit.save) as a torch::nn::Module that Model trains like any other — replicas, mirrored
// buffers, checkpoints and resume — under the module's own parameter and buffer names, so a
// checkpoint's model.safetensors loads straight into the original nn.Module with load_state_dict.
//
// Why TorchScript: LibTorch 2.11 trains nothing else that Python exports. torch.export's programs
// reach C++ only through AOTInductor (torch/csrc/inductor/aoti_runner, aoti_package), whose
// runners map input tensors to output tensors with no autograd: inference only. In Python:
//   scripted = torch.jit.script(model)   # or torch.jit.trace(model, example_batch)
//   scripted.save("model.pt")
//
// The forward runs op by op (the graph executor's optimisations off, on the calling thread only),
// as eager PyTorch runs it: its gradients are eager PyTorch's, autocast applies as it does to any
// LibTorch module, and no profiling runs make the first steps differ from the later ones.
// convert_sync_batchnorm() makes its BatchNorms SyncBatchNorms (the statistics of the whole global
// batch) by rewriting the compiled graphs: each aten::batch_norm becomes flotilla::sync_batch_norm,
// the same computation as train::SyncBatchNorm's. Without it, each replica normalises its own
// slice and keeps its own statistics, mirrored where they are read (Model::mirror_buffers).
#pragma once

#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <string>

#include "flotilla/kernels/compile.h"
#include "flotilla/strategy/replica_context.h"
#include "flotilla/train/model.h"

namespace flotilla::train {

class TorchScriptModuleImpl : public torch::nn::Module {
 public:
  // `source`: where it came from (a path), for messages. ConfigError when its forward takes no
  // input.
  explicit TorchScriptModuleImpl(torch::jit::Module module, std::string source = "");

  // ConfigError naming the source when forward takes several inputs or returns anything but one
  // tensor; torch's own errors pass through as they are (see check_forward for a clear
  // first-batch check).
  torch::Tensor forward(const torch::Tensor& x);
  // A forward of several inputs (the arguments without defaults, in order) and outputs: a tensor,
  // or a tuple, list or dict of tensors (a dict's values in its order). ConfigError for a count of
  // inputs other than inputs() or an output of anything else.
  Tensors forward_all(const Tensors& inputs);
  // The tensors forward requires (its arguments without defaults).
  int inputs() const { return inputs_; }
  void train(bool on = true) override;
  // A deep copy (its own parameters and buffers), for another replica.
  std::shared_ptr<torch::nn::Module>
  clone(const std::optional<torch::Device>& device = std::nullopt) const override;

  // PyTorch's convert_sync_batchnorm for a TorchScript module: every batch_norm its methods call
  // (BatchNorm1d/2d/3d, F.batch_norm, traced or scripted) computes with the global batch's
  // statistics in training, once Model::compile() has bound each replica. Returns the number of
  // BatchNorm layers (submodules), or of batch_norm calls where it has none. Before the first
  // forward (the graphs are compiled then): ConfigError after. Copies made by clone() share it.
  int convert_sync_batchnorm();
  int sync_batchnorm_layers() const { return sync_layers_; }
  // The compile step on the CPU (flotilla/kernels/compile.h; Model::compile runs it under
  // CompileOptions::jit_compile): forward from then on is a rewritten copy of the module's,
  // holding the same tensors. Any time, even after forwards ran. After convert_sync_batchnorm,
  // whose BatchNorms it leaves as they are. `bfloat16`: it will train under bfloat16 autocast.
  kernels::CompileReport compile_kernels(bool bfloat16 = false);
  // A trace records BatchNorm's mode as a constant: true when one was traced in training mode
  // (it then normalises with batch statistics in evaluation too). load_torchscript warns.
  bool traced_in_training_mode() const;
  // The replica this copy runs on (bind_sync_batchnorm, from Model::compile()).
  void set_replica_context(strategy::ReplicaContext context) { context_ = std::move(context); }

  torch::jit::Module& script() { return script_; }
  const std::string& source() const { return source_; }

 private:
  c10::IValue run(std::vector<c10::IValue> inputs);

  torch::jit::Module script_;
  std::string source_;
  int inputs_ = 1;
  int sync_layers_ = 0;
  bool has_run_ = false;
  strategy::ReplicaContext context_;
};
TORCH_MODULE(TorchScriptModule);

// A TorchScript module of several inputs or outputs as a Model's (Model(strategy, module,
// torchscript_forward(module), Signature{inputs, outputs}, torchscript_clone(module))).
Model::MultiForward torchscript_forward(const TorchScriptModule& module);
// Deep copies of `module` with their forwards, for a worker's other replicas.
std::function<Model::MultiReplica()> torchscript_clone(const TorchScriptModule& module);

// torch::jit::load onto the CPU. ConfigError (one line: the path, what it is, torch's message)
// for a missing file or one that is not a TorchScript module. A parameter held under two names
// (tied weights) is trained once, under its first name; a checkpoint then holds that name only
// (load it in Python with strict=False, or re-tie after loading).
TorchScriptModule load_torchscript(const std::string& path);

// Runs forward once on `sample` in training mode (no gradients; buffers and mode restored) so that a model that
// cannot take the input fails before training starts, on every worker alike, rather than inside
// a step while the other workers wait in a collective. ConfigError naming the source, the
// sample's shape and dtype, and torch's own message. Returns the outputs.
torch::Tensor check_forward(TorchScriptModule& module, const torch::Tensor& sample);

} // namespace flotilla::train
