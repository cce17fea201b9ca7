#include "flotilla/kernels/compile.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/library.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "flotilla/kernels/batch_norm_relu.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/conv_pool_relu.h"
#include "flotilla/kernels/dropout.h"
#include "flotilla/kernels/max_pool_relu.h"
#include "flotilla/kernels/modules.h"
#include "flotilla/kernels/winograd.h"

namespace flotilla::kernels {
namespace nn = torch::nn;
namespace jit = torch::jit;

// --- the operations a rewritten TorchScript graph calls ---

namespace {

at::Tensor script_conv2d(const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                         c10::IntArrayRef padding, c10::IntArrayRef dilation, std::int64_t groups) {
  return kernels::conv2d(input, weight, bias, stride, padding, dilation, groups);
}

at::Tensor script_batch_norm_relu(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& running_mean,
                                  const std::optional<at::Tensor>& running_var, bool training,
                                  double momentum, double eps,
                                  const std::optional<at::Tensor>& residual,
                                  std::optional<double> ceiling) {
  return batch_norm_relu(input, weight, bias, running_mean, running_var, training, momentum, eps,
                         residual, ceiling);
}

} // namespace

// aten's schemas (batch_norm's running statistics are updated in place, as aten::batch_norm's
// are, which declares no mutation either).
TORCH_LIBRARY_FRAGMENT(flotilla, m) {
  m.def("conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
        "int[2] dilation, int groups) -> Tensor");
  m.def("batch_norm_relu(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
        "Tensor? running_var, bool training, float momentum, float eps, Tensor? residual, "
        "float? ceiling=None) -> Tensor");
}
// Above autograd: each computes its own gradients (torch::autograd::Function) or calls ATen's.
TORCH_LIBRARY_IMPL(flotilla, CompositeImplicitAutograd, m) {
  m.impl("conv2d", TORCH_FN(script_conv2d));
  m.impl("batch_norm_relu", TORCH_FN(script_batch_norm_relu));
}

std::string CompileReport::summary() const {
  const auto list = [](const std::map<std::string, int>& counts) {
    std::string text;
    for (const auto& [what, n] : counts) {
      text += (text.empty() ? "" : ", ") + std::to_string(n) + " " + what;
    }
    return text;
  };
  std::string text = rewritten.empty() ? "nothing rewritten" : "rewrote " + list(rewritten);
  if (!left.empty()) text += "; left to ATen: " + list(left);
  return text;
}

// --- torch::nn trees ---

namespace {

// What the report calls a convolution that computes in float32 under bfloat16 autocast.
constexpr const char* kOtherConvolutions = "other convolutions (bfloat16 in float32 arithmetic)";

template <class T> T* as(const std::shared_ptr<nn::Module>& m) {
  return dynamic_cast<T*>(m.get());
}

bool both(const torch::ExpandingArray<2>& a, std::int64_t v) {
  return (*a)[0] == v && (*a)[1] == v;
}

bool padding_is(const nn::detail::ConvNdOptions<2>& o, std::int64_t v) {
  const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
  return padding != nullptr && both(*padding, v) &&
         std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode());
}

// Why Winograd's kernels cannot take this Conv2d, or "" where they can.
std::string why_not_winograd(const nn::detail::ConvNdOptions<2>& o) {
  if (!both(o.kernel_size(), 3)) return "not 3x3";
  if (!both(o.stride(), 1)) return "stride " + std::to_string((*o.stride())[0]);
  if (!padding_is(o, 1)) return "padding not 1";
  if (!both(o.dilation(), 1)) return "dilated";
  if (o.groups() != 1) return "grouped";
  if (o.transposed()) return "transposed";
  if (o.bias()) return "with a bias";
  if (o.in_channels() % 16 || o.out_channels() % 16 || o.in_channels() > 512 ||
      o.out_channels() > 512) {
    return "channels not multiples of 16 up to 512";
  }
  return "";
}

// Why a Conv2d cannot compute in float32 under bfloat16 autocast (convolution.h), or "".
std::string why_not_float32(const nn::detail::ConvNdOptions<2>& o) {
  if (o.transposed()) return "transposed";
  if (!std::holds_alternative<torch::ExpandingArray<2>>(o.padding())) return "padding by name";
  if (!std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) {
    return "padding mode not zeros";
  }
  return "";
}

// A Conv2d that conv_max_pool2_relu's kernel takes: 1 -> 16k channels, 3x3, padding 1, a bias.
bool first_layer(const nn::Conv2dImpl& c) {
  const auto& o = c.options;
  return o.in_channels() == 1 && o.out_channels() % 16 == 0 && both(o.kernel_size(), 3) &&
         both(o.stride(), 1) && padding_is(o, 1) && both(o.dilation(), 1) && o.groups() == 1 &&
         !o.transposed() && o.bias();
}

bool pool2(const std::shared_ptr<nn::Module>& m) {
  const auto* p = as<nn::MaxPool2dImpl>(m);
  if (p == nullptr) return false;
  const auto& o = p->options;
  return both(o.kernel_size(), 2) && both(o.stride(), 2) && both(o.padding(), 0) &&
         both(o.dilation(), 1) && !o.ceil_mode();
}

bool relu(const std::shared_ptr<nn::Module>& m) {
  return as<nn::ReLUImpl>(m) != nullptr;
}

bool relu6(const std::shared_ptr<nn::Module>& m) {
  return as<nn::ReLU6Impl>(m) != nullptr;
}

class SequentialRewriter {
 public:
  SequentialRewriter(nn::SequentialImpl& seq, CompileReport& report, bool bfloat16)
      : seq_(seq), report_(report), bfloat16_(bfloat16) {
    for (const auto& child : seq.named_children()) names_.push_back(child.key());
  }

  void run() {
    const std::size_t n = seq_.size();
    for (std::size_t i = 0; i < n; ++i) {
      const auto m = seq_.ptr(i);
      const auto next = [&](std::size_t k) {
        return i + k < n ? seq_.ptr(i + k) : std::shared_ptr<nn::Module>();
      };
      if (auto* conv = as<nn::Conv2dImpl>(m)) {
        if (first_layer(*conv) && relu(next(1)) && pool2(next(2))) {
          swap(i, ConvMaxPool2ReLU(*conv).ptr(), "first layers (Conv2d, ReLU, MaxPool2d)", 3);
          i += 2;
        } else if (const std::string why = why_not_winograd(conv->options); why.empty()) {
          swap(i, Conv2d(nn::Conv2d(std::dynamic_pointer_cast<nn::Conv2dImpl>(m))).ptr(),
               "3x3 convolutions", 1);
        } else if (const std::string why_not = why_not_float32(conv->options);
                   bfloat16_ && why_not.empty()) {
          swap(i, Conv2d(nn::Conv2d(std::dynamic_pointer_cast<nn::Conv2dImpl>(m))).ptr(),
               kOtherConvolutions, 1);
        } else {
          ++report_.left["Conv2d (" + (bfloat16_ ? why_not : why) + ")"];
        }
      } else if (auto* bn = as<nn::BatchNorm2dImpl>(m)) {
        const nn::BatchNorm2d held(std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(m));
        if (relu(next(1)) && bn->options.affine()) {
          swap(i, BatchNormReLU(held).ptr(), "BatchNorm+ReLU", 2);
          ++i;
        } else if (relu6(next(1)) && bn->options.affine()) {
          swap(i, BatchNormReLU(held, 6.0).ptr(), "BatchNorm+ReLU6", 2);
          ++i;
        } else {
          ++report_.left[std::string("BatchNorm2d (") +
                         (bn->options.affine() ? "not followed by ReLU" : "affine=false") + ")"];
        }
      } else if ((relu(m) && pool2(next(1))) || (pool2(m) && relu(next(1)))) {
        swap(i, MaxPool2ReLU().ptr(), "ReLU+MaxPool2d", 2);
        ++i;
      } else if (auto* gelu = as<nn::GELUImpl>(m);
                 gelu && gelu->options.approximate() == "none" && as<nn::DropoutImpl>(next(1))) {
        swap(i, GeluDropout(as<nn::DropoutImpl>(next(1))->options.p()).ptr(), "GELU+Dropout", 2);
        ++i;
      } else if (auto* dropout = as<nn::DropoutImpl>(m)) {
        swap(i, Dropout(dropout->options.p()).ptr(), "Dropout", 1);
      }
    }
  }

 private:
  // Layers i .. i + count - 1 become `module` and Identity, under their own names.
  template <class M>
  void swap(std::size_t i, std::shared_ptr<M> module, const std::string& what, std::size_t count) {
    module->train(seq_.ptr(i)->is_training());
    put(i, nn::AnyModule(module));
    for (std::size_t k = 1; k < count; ++k) put(i + k, nn::AnyModule(nn::Identity()));
    ++report_.rewritten[what];
  }
  void put(std::size_t i, nn::AnyModule module) {
    seq_.replace_module(names_[i], module.ptr());
    *(seq_.begin() + static_cast<std::ptrdiff_t>(i)) = std::move(module);
  }

  nn::SequentialImpl& seq_;
  CompileReport& report_;
  bool bfloat16_;
  std::vector<std::string> names_;
};

// Every Sequential in the tree, and the layers of the kinds the step rewrites that sit in
// another module (its forward calls them by member; nothing can swap them).
void visit(nn::Module& module, CompileReport& report, bool bfloat16) {
  if (auto* seq = dynamic_cast<nn::SequentialImpl*>(&module)) {
    SequentialRewriter(*seq, report, bfloat16).run();
  } else {
    for (const auto& child : module.children()) {
      if (as<nn::Conv2dImpl>(child)) ++report.left["Conv2d (outside a Sequential)"];
      if (as<nn::BatchNorm2dImpl>(child)) ++report.left["BatchNorm2d (outside a Sequential)"];
      if (as<nn::DropoutImpl>(child)) ++report.left["Dropout (outside a Sequential)"];
    }
  }
  for (const auto& child : module.children()) visit(*child, report, bfloat16);
}

} // namespace

CompileReport compile(nn::Module& module, bool bfloat16) {
  CompileReport report;
  if (mode() == Mode::kNone) return report;
  visit(module, report, bfloat16);
  return report;
}

// --- TorchScript graphs ---

namespace {

const c10::Symbol kConv2d = c10::Symbol::fromQualString("aten::conv2d");
const c10::Symbol kConvolution = c10::Symbol::fromQualString("aten::_convolution");
const c10::Symbol kBatchNorm = c10::Symbol::fromQualString("aten::batch_norm");
const c10::Symbol kRelu = c10::Symbol::fromQualString("aten::relu");
const c10::Symbol kReluInPlace = c10::Symbol::fromQualString("aten::relu_");
const c10::Symbol kHardtanh = c10::Symbol::fromQualString("aten::hardtanh");
const c10::Symbol kHardtanhInPlace = c10::Symbol::fromQualString("aten::hardtanh_");
const c10::Symbol kAdd = c10::Symbol::fromQualString("aten::add");
const c10::Symbol kAddInPlace = c10::Symbol::fromQualString("aten::add_");
const c10::Symbol kOurConv2d = c10::Symbol::fromQualString("flotilla::conv2d");
const c10::Symbol kOurBatchNormRelu = c10::Symbol::fromQualString("flotilla::batch_norm_relu");

std::optional<c10::IValue> constant(jit::Value* v) {
  return jit::toIValue(v);
}

bool int_list_is(jit::Value* v, std::int64_t value) {
  const auto c = constant(v);
  if (!c || !c->isIntList()) return false;
  const auto list = c->toIntVector();
  return list.size() == 2 && list[0] == value && list[1] == value;
}

// The value a chain of prim::GetAttr from the graph's `self` names in `module`, where it is one.
std::optional<c10::IValue> attribute(jit::Value* v, const jit::Module& module) {
  std::vector<std::string> path;
  while (v->node()->kind() == jit::prim::GetAttr) {
    path.push_back(v->node()->s(jit::attr::name));
    v = v->node()->input();
  }
  if (v->node()->kind() != jit::prim::Param || v->offset() != 0 || path.empty()) {
    return std::nullopt;
  }
  c10::IValue value = module._ivalue();
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    if (!value.isObject()) return std::nullopt;
    const auto object = value.toObject();
    if (!object->type()->hasAttribute(*it)) return std::nullopt;
    value = object->getAttr(*it);
  }
  return value;
}

// A constant None, or a module's attribute that is None (a Conv2d's bias where it has none: of
// type Optional[Tensor], so the graph alone cannot tell). Should it become a tensor,
// flotilla::conv2d runs ATen's with it: the rewrite stays right.
bool is_none(jit::Value* v, const jit::Module& module) {
  if (v->type()->kind() == c10::TypeKind::NoneType) return true;
  auto c = constant(v);
  if (!c) c = attribute(v, module);
  return c && c->isNone();
}

// The nodes of these kinds in the block and the blocks inside it, found before any is changed
// (a rewrite destroys nodes after the one it starts from).
std::vector<jit::Node*> nodes_of(jit::Block* block, const std::vector<c10::Symbol>& kinds) {
  std::vector<jit::Node*> found;
  for (jit::Node* node : block->nodes()) {
    for (jit::Block* inner : node->blocks()) {
      const auto more = nodes_of(inner, kinds);
      found.insert(found.end(), more.begin(), more.end());
    }
    if (std::find(kinds.begin(), kinds.end(), node->kind()) != kinds.end()) found.push_back(node);
  }
  return found;
}

// Counts one layer in `counts` under `what`: once per layer, however many places the graph calls
// it from (a branch on a module's flag, inlined, holds its layers' calls twice). `layer`: the
// layer's parameter a chain of prim::GetAttr names ("features.3.conv.1.weight"), "" where none
// does (then each call counts).
class LayerCounter {
 public:
  explicit LayerCounter(CompileReport& report) : report_(report) {}
  void count(bool rewritten, const std::string& what, const std::string& layer) {
    if (!layer.empty() && !seen_.insert(what + " " + layer).second) return;
    ++(rewritten ? report_.rewritten : report_.left)[what];
  }

 private:
  CompileReport& report_;
  std::set<std::string> seen_;
};

// The attribute path of a chain of prim::GetAttr from the graph's `self`, or "".
std::string attribute_path(jit::Value* v) {
  std::string path;
  while (v->node()->kind() == jit::prim::GetAttr) {
    path = v->node()->s(jit::attr::name) + (path.empty() ? "" : ".") + path;
    v = v->node()->input();
  }
  return v->node()->kind() == jit::prim::Param && v->offset() == 0 ? path : "";
}

// aten::conv2d(input, weight, bias, stride, padding, dilation, groups), or a trace's
// aten::_convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
// groups, ...) of two dimensions, to flotilla::conv2d where the options are Winograd's, or
// under `bfloat16` where its padding is given as numbers (not "same" or "valid").
void rewrite_convolution(jit::Node* node, const jit::Module& module, bool bfloat16,
                         LayerCounter& counter) {
  const bool conv2d = node->kind() == kConv2d && node->inputs().size() == 7;
  const bool convolution = node->kind() == kConvolution && node->inputs().size() >= 9;
  if (!conv2d && !convolution) return;
  jit::Value* groups = node->input(conv2d ? 6 : 8);
  const auto w = attribute(node->input(1), module);
  const bool known = w && w->isTensor();
  const auto stride = constant(node->input(3));
  // why_not_ours: flotilla::conv2d cannot take it (it stays aten's); else why: Winograd's kernels
  // cannot. Under bfloat16 whatever flotilla::conv2d takes is rewritten: Winograd's where `why`
  // is empty, float32 arithmetic (convolution.h) otherwise.
  std::string why_not_ours, why;
  if (convolution && (!constant(node->input(6)) || constant(node->input(6))->toBool())) {
    why_not_ours = "transposed";
  } else if ((stride && stride->isIntList() && stride->toIntVector().size() != 2) ||
             (known && w->toTensor().dim() != 4)) {
    why_not_ours = "not 2-D";
  } else if (node->input(4)->type()->kind() != c10::TypeKind::ListType) {
    why_not_ours = "padding by name";
  } else if (known && (w->toTensor().size(2) != 3 || w->toTensor().size(3) != 3)) {
    why = "not 3x3";
  } else if (!constant(groups) || constant(groups)->toInt() != 1) {
    why = "grouped";
  } else if (!int_list_is(node->input(3), 1)) {
    why = "stride not 1";
  } else if (!int_list_is(node->input(4), 1)) {
    why = "padding not 1";
  } else if (!int_list_is(node->input(5), 1)) {
    why = "dilated";
  } else if (!is_none(node->input(2), module)) {
    why = "with a bias";
  } else if (known) {
    const at::Tensor& t = w->toTensor();
    if (t.size(0) % 16 || t.size(1) % 16 || t.size(0) > 512 || t.size(1) > 512) {
      why = "channels not multiples of 16 up to 512";
    }
  }
  const std::string layer = attribute_path(node->input(1));
  if (!why_not_ours.empty() || (!why.empty() && !bfloat16)) {
    counter.count(false, "convolutions (" + why_not_ours + why + ")", layer);
    return;
  }
  const bool other = !why.empty();
  jit::Graph& graph = *node->owningGraph();
  jit::WithInsertPoint here(node);
  jit::Node* ours = graph.insertNode(graph.create(
      kOurConv2d, {node->input(0), node->input(1), node->input(2), node->input(3), node->input(4),
                   node->input(5), groups},
      1));
  ours->output()->setType(node->output()->type());
  node->output()->replaceAllUsesWith(ours->output());
  node->destroy();
  counter.count(true, other ? kOtherConvolutions : "3x3 convolutions", layer);
}

// A ReLU: relu or relu_ (nullopt ceiling), or hardtanh(0, c) as ReLU6 makes (ceiling c); false
// for anything else.
bool is_relu(jit::Node* n, std::optional<double>& ceiling) {
  ceiling.reset();
  if (n->kind() == kRelu || n->kind() == kReluInPlace) return true;
  if ((n->kind() != kHardtanh && n->kind() != kHardtanhInPlace) || n->inputs().size() != 3) {
    return false;
  }
  const auto low = constant(n->input(1)), high = constant(n->input(2));
  if (!low || !high || !low->isScalar() || !high->isScalar() || low->toScalar().toDouble() != 0 ||
      !(high->toScalar().toDouble() > 0)) {
    return false;
  }
  ceiling = high->toScalar().toDouble();
  return true;
}

// The one node that uses v, where exactly one does.
jit::Node* only_user(jit::Value* v) {
  return v->uses().size() == 1 ? v->uses()[0].user : nullptr;
}

// aten::batch_norm then relu, or then add and relu, to flotilla::batch_norm_relu.
void rewrite_batch_norm(jit::Node* node, LayerCounter& counter) {
  if (node->kind() != kBatchNorm || node->inputs().size() != 9) return;
  const std::string layer = attribute_path(node->input(3)); // its running mean
  jit::Value* out = node->output();
  jit::Node* user = only_user(out);
  jit::Node* last = nullptr;
  jit::Value* residual = nullptr;
  std::optional<double> ceiling;
  if (user && is_relu(user, ceiling) && user->owningBlock() == node->owningBlock()) {
    last = user;
  } else if (user && (user->kind() == kAdd || user->kind() == kAddInPlace) &&
             user->inputs().size() == 3 && user->owningBlock() == node->owningBlock()) {
    const auto alpha = constant(user->input(2));
    // add_ writes into its first input: only bn's output may be that.
    const bool first = user->input(0) == out && user->input(1) != out;
    const bool second = user->kind() == kAdd && user->input(1) == out && user->input(0) != out;
    jit::Node* then = only_user(user->output());
    const bool tensor = user->input(first ? 1 : 0)->type()->cast<c10::TensorType>() != nullptr;
    if (alpha && alpha->isInt() && alpha->toInt() == 1 && (first || second) && tensor && then &&
        is_relu(then, ceiling) && then->owningBlock() == node->owningBlock()) {
      last = then;
      residual = user->input(first ? 1 : 0);
    }
  }
  if (last == nullptr) {
    counter.count(false, "batch_norm (not followed by relu or relu6)", layer);
    return;
  }
  jit::Graph& graph = *node->owningGraph();
  jit::WithInsertPoint here(last);
  jit::Value* none = residual ? residual : graph.insertConstant(c10::IValue());
  std::vector<jit::Value*> inputs(node->inputs().begin(), node->inputs().begin() + 8);
  inputs.push_back(none);
  inputs.push_back(graph.insertConstant(ceiling ? c10::IValue(*ceiling) : c10::IValue()));
  jit::Node* ours = graph.insertNode(graph.create(kOurBatchNormRelu, inputs, 1));
  ours->output()->setType(last->output()->type());
  last->output()->replaceAllUsesWith(ours->output());
  jit::Node* add = residual ? user : nullptr;
  last->destroy();
  if (add) add->destroy();
  node->destroy();
  counter.count(true,
                std::string(residual ? "batch_norm+add+" : "batch_norm+") +
                    (!ceiling ? "relu" : *ceiling == 6 ? "relu6" : "hardtanh"),
                layer);
}

} // namespace

jit::Module compile(const jit::Module& module, CompileReport& report, bool bfloat16) {
  if (mode() == Mode::kNone || !module.find_method("forward")) return module;
  // A copy with methods of its own (fresh, never run) and the same tensors.
  jit::Module copy = module.clone(/*inplace=*/true);
  auto graph = jit::toGraphFunction(copy.get_method("forward").function()).graph();
  jit::Inline(*graph);
  // Folds the branches on the layers' constants (F.relu's inplace, Conv2d's padding mode), so a
  // batch_norm meets the relu after it.
  jit::ConstantPropagation(graph);
  LayerCounter counter(report);
  for (jit::Node* n : nodes_of(graph->block(), {kConv2d, kConvolution})) {
    rewrite_convolution(n, copy, bfloat16, counter);
  }
  for (jit::Node* n : nodes_of(graph->block(), {kBatchNorm})) rewrite_batch_norm(n, counter);
  jit::EliminateDeadCode(graph);
  return copy;
}

} // namespace flotilla::kernels
