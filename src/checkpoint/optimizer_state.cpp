#include "flotilla/checkpoint/optimizer_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "flotilla/error.h"

namespace flotilla::checkpoint {
namespace {

// kOther: kept in LibTorch's own archive (Optimizer::save/load) as one tensor.
enum class OptimizerKind { kSGD, kAdam, kAdamW, kOther };

constexpr const char* kArchiveName = "torch_archive";

OptimizerKind kind_of(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return OptimizerKind::kSGD;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return OptimizerKind::kAdam;
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return OptimizerKind::kAdamW;
  return OptimizerKind::kOther;
}

std::string type_name(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

std::string archive_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

torch::serialize::InputArchive read_archive(const std::string& bytes,
                                            std::optional<torch::Device> device = std::nullopt) {
  torch::serialize::InputArchive archive;
  std::istringstream in(bytes);
  archive.load_from(in, device);
  return archive;
}

// LibTorch's optimizers write their version, groups and state; torch::optim::Optimizer's own
// save() writes nothing.
bool holds_optimizer(torch::serialize::InputArchive& archive) {
  const auto keys = archive.keys();
  return std::find(keys.begin(), keys.end(), "pytorch_version") != keys.end();
}

NamedTensors archived_state(const torch::optim::Optimizer& optimizer) {
  const std::string bytes = archive_bytes(optimizer);
  auto check = read_archive(bytes);
  if (!holds_optimizer(check)) {
    throw CheckpointError("optimizer state: " + type_name(optimizer) +
                          " does not save its state (its save() writes nothing); implement "
                          "save() and load() as LibTorch's optimizers do (with "
                          "torch::optim::serialize) to checkpoint it, back it up or heal a fit "
                          "that uses it");
  }
  torch::Tensor tensor = torch::empty({static_cast<std::int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return {{kArchiveName, tensor}};
}

// Every state tensor of more than one element has its parameter's shape (LibTorch's own load
// checks the groups' sizes, not the tensors').
void check_archived_shapes(const torch::optim::Optimizer& optimizer) {
  std::int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      const auto it = optimizer.state().find(param.unsafeGetTensorImpl());
      ++index;
      if (it == optimizer.state().end() || !it->second) continue;
      torch::serialize::OutputArchive out;
      it->second->serialize(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      auto in = read_archive(bytes.str());
      for (const auto& key : in.keys()) {
        torch::Tensor t;
        if (!in.try_read(key, t) || t.dim() == 0 || t.numel() <= 1) continue;
        if (t.sizes() != param.sizes()) {
          throw CheckpointError("optimizer state: parameter " + std::to_string(index - 1) +
                                "'s \"" + key + "\" has shape " + c10::str(t.sizes()) +
                                ", the parameter has shape " + c10::str(param.sizes()) +
                                "; it was saved from a different model");
        }
      }
    }
  }
}

void load_archived_state(torch::optim::Optimizer& optimizer, const NamedTensors& state) {
  const std::string where = "optimizer state: ";
  if (state.size() != 1 || state.front().first != kArchiveName) {
    throw CheckpointError(where + "this " + type_name(optimizer) +
                          " keeps its state in LibTorch's archive (\"" + kArchiveName +
                          "\"); saw " +
                          (state.empty() ? "nothing" : "\"" + state.front().first + "\"") +
                          ": it was saved from another optimizer");
  }
  const torch::Tensor bytes_tensor = state.front().second.to(torch::kCPU).contiguous();
  if (bytes_tensor.scalar_type() != torch::kUInt8 || bytes_tensor.dim() != 1) {
    throw CheckpointError(where + "\"" + kArchiveName + "\" is not a byte string");
  }
  const std::string bytes(static_cast<const char*>(bytes_tensor.data_ptr()),
                          static_cast<std::size_t>(bytes_tensor.numel()));
  std::optional<torch::Device> device;
  if (!optimizer.param_groups().empty() && !optimizer.param_groups()[0].params().empty()) {
    device = optimizer.param_groups()[0].params()[0].device();
  }
  const std::string previous = archive_bytes(optimizer);
  try {
    auto archive = read_archive(bytes, device);
    if (!holds_optimizer(archive)) throw CheckpointError("it holds no optimizer");
    optimizer.load(archive);
    check_archived_shapes(optimizer);
  } catch (const std::exception& e) {
    // Put back what was there: LibTorch's load() changes state group by group.
    optimizer.state().clear();
    auto before = read_archive(previous, device);
    optimizer.load(before);
    const c10::Error* error = dynamic_cast<const c10::Error*>(&e);
    throw CheckpointError(where + "could not load it into this " + type_name(optimizer) + " (" +
                          (error ? error->what_without_backtrace() : e.what()) +
                          "); it was saved from a different optimizer or model");
  }
}

const char* kind_name(OptimizerKind kind) {
  switch (kind) {
  case OptimizerKind::kSGD:
    return "SGD";
  case OptimizerKind::kAdam:
    return "Adam";
  case OptimizerKind::kAdamW:
    return "AdamW";
  case OptimizerKind::kOther:
    break;
  }
  return "?";
}

bool amsgrad(OptimizerKind kind, const torch::optim::OptimizerOptions& options) {
  if (kind == OptimizerKind::kAdam) {
    return static_cast<const torch::optim::AdamOptions&>(options).amsgrad();
  }
  if (kind == OptimizerKind::kAdamW) {
    return static_cast<const torch::optim::AdamWOptions&>(options).amsgrad();
  }
  return false;
}

std::vector<std::string> expected_fields(OptimizerKind kind, bool with_amsgrad) {
  if (kind == OptimizerKind::kSGD) return {"momentum_buffer"};
  std::vector<std::string> fields = {"step", "exp_avg", "exp_avg_sq"};
  if (with_amsgrad) fields.push_back("max_exp_avg_sq");
  return fields;
}

template <class AdamState>
void add_adam_state(NamedTensors& out, const std::string& prefix, const AdamState& state) {
  out.emplace_back(prefix + "step", torch::scalar_tensor(state.step(), torch::kInt64));
  if (state.exp_avg().defined()) out.emplace_back(prefix + "exp_avg", state.exp_avg().detach());
  if (state.exp_avg_sq().defined()) {
    out.emplace_back(prefix + "exp_avg_sq", state.exp_avg_sq().detach());
  }
  if (state.max_exp_avg_sq().defined()) {
    out.emplace_back(prefix + "max_exp_avg_sq", state.max_exp_avg_sq().detach());
  }
}

// "<digits>.<rest>" -> (number, rest); nullopt when it is not that.
std::optional<std::pair<std::int64_t, std::string>> split_index(const std::string& text) {
  const std::size_t dot = text.find('.');
  if (dot == 0 || dot == std::string::npos || dot > 12) return std::nullopt;
  for (std::size_t i = 0; i < dot; ++i) {
    if (!std::isdigit(static_cast<unsigned char>(text[i]))) return std::nullopt;
  }
  return std::make_pair(std::stoll(text.substr(0, dot)), text.substr(dot + 1));
}

template <class AdamState>
std::unique_ptr<torch::optim::OptimizerParamState>
make_adam_state(const std::map<std::string, torch::Tensor>& fields,
                const std::function<torch::Tensor(const torch::Tensor&)>& like_param) {
  auto state = std::make_unique<AdamState>();
  state->step(fields.at("step").item<std::int64_t>());
  state->exp_avg(like_param(fields.at("exp_avg")));
  state->exp_avg_sq(like_param(fields.at("exp_avg_sq")));
  const auto max = fields.find("max_exp_avg_sq");
  if (max != fields.end()) state->max_exp_avg_sq(like_param(max->second));
  return state;
}

} // namespace

NamedTensors optimizer_state(const torch::optim::Optimizer& optimizer) {
  const OptimizerKind kind = kind_of(optimizer);
  if (kind == OptimizerKind::kOther) return archived_state(optimizer);
  const auto& states = optimizer.state();
  NamedTensors out;
  std::int64_t index = 0;
  const auto& groups = optimizer.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& param : groups[g].params()) {
      const std::string prefix = "state." + std::to_string(index++) + ".";
      const auto it = states.find(param.unsafeGetTensorImpl());
      if (it == states.end() || !it->second) continue;
      const auto* state = it->second.get();
      bool known = false;
      if (kind == OptimizerKind::kSGD) {
        if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
          known = true;
          if (s->momentum_buffer().defined()) {
            out.emplace_back(prefix + "momentum_buffer", s->momentum_buffer().detach());
          }
        }
      } else if (kind == OptimizerKind::kAdam) {
        if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
          known = true;
          add_adam_state(out, prefix, *s);
        }
      } else if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
        known = true;
        add_adam_state(out, prefix, *s);
      }
      if (!known) {
        throw CheckpointError(std::string("optimizer state: parameter ") +
                              std::to_string(index - 1) + " of this " + kind_name(kind) +
                              " optimizer holds state of another type (" +
                              c10::demangle(typeid(*state).name()) + ")");
      }
    }
    out.emplace_back("param_groups." + std::to_string(g) + ".lr",
                     torch::scalar_tensor(groups[g].options().get_lr(), torch::kFloat64));
  }
  return out;
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, const NamedTensors& state) {
  const OptimizerKind kind = kind_of(optimizer);
  if (kind == OptimizerKind::kOther) return load_archived_state(optimizer, state);
  const std::string kind_text = kind_name(kind);
  const std::string where = "optimizer state: ";
  auto& groups = optimizer.param_groups();
  struct Param {
    torch::Tensor tensor;
    std::size_t group;
  };
  std::vector<Param> params;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) params.push_back({p, g});
  }

  // Check everything first.
  std::map<std::int64_t, std::map<std::string, torch::Tensor>> per_param;
  std::map<std::int64_t, double> rates;
  for (const auto& [name, tensor] : state) {
    const auto unexpected = [&](const std::string& why) {
      return CheckpointError(where + "unexpected tensor \"" + name + "\": " + why +
                             "; it was saved from a different optimizer or model");
    };
    if (!tensor.defined()) throw CheckpointError(where + "tensor \"" + name + "\" is undefined");
    if (name.rfind("state.", 0) == 0) {
      const auto split = split_index(name.substr(6));
      if (!split) throw unexpected("expected \"state.<parameter>.<field>\"");
      const auto [index, field_name] = *split;
      if (index >= static_cast<std::int64_t>(params.size())) {
        throw unexpected("this optimizer has " + std::to_string(params.size()) + " parameters");
      }
      const auto& param = params[static_cast<std::size_t>(index)];
      const auto fields = expected_fields(kind, amsgrad(kind, groups[param.group].options()));
      if (std::find(fields.begin(), fields.end(), field_name) == fields.end()) {
        throw unexpected("this " + kind_text + " optimizer has no state \"" + field_name + "\"" +
                         (field_name == "max_exp_avg_sq" ? " (amsgrad is off)" : ""));
      }
      if (field_name == "step") {
        if (tensor.numel() != 1) {
          throw CheckpointError(where + "tensor \"" + name + "\" has shape " +
                                c10::str(tensor.sizes()) + ", expected a single number");
        }
      } else if (tensor.sizes() != param.tensor.sizes()) {
        throw CheckpointError(where + "tensor \"" + name + "\" has shape " +
                              c10::str(tensor.sizes()) + ", parameter " + std::to_string(index) +
                              " has shape " + c10::str(param.tensor.sizes()) +
                              "; it was saved from a different model");
      }
      if (!per_param[index].emplace(field_name, tensor).second) {
        throw CheckpointError(where + "tensor \"" + name + "\" appears twice");
      }
    } else if (name.rfind("param_groups.", 0) == 0) {
      const auto split = split_index(name.substr(13));
      if (!split || split->second != "lr") throw unexpected("expected \"param_groups.<g>.lr\"");
      if (split->first >= static_cast<std::int64_t>(groups.size())) {
        throw unexpected("this optimizer has " + std::to_string(groups.size()) +
                         " parameter groups");
      }
      if (tensor.numel() != 1) {
        throw CheckpointError(where + "tensor \"" + name + "\" has shape " +
                              c10::str(tensor.sizes()) + ", expected a single number");
      }
      if (!rates.emplace(split->first, tensor.item<double>()).second) {
        throw CheckpointError(where + "tensor \"" + name + "\" appears twice");
      }
    } else if (name == kArchiveName) {
      throw unexpected("that is LibTorch's archive of an optimizer other than SGD, Adam and AdamW");
    } else {
      throw unexpected("names start with \"state.\" or \"param_groups.\"");
    }
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (!rates.count(static_cast<std::int64_t>(g))) {
      throw CheckpointError(where + "has no \"param_groups." + std::to_string(g) +
                            ".lr\"; it was saved from a different optimizer");
    }
  }
  for (const auto& [index, fields] : per_param) {
    const auto& param = params[static_cast<std::size_t>(index)];
    for (const auto& expected :
         expected_fields(kind, amsgrad(kind, groups[param.group].options()))) {
      if (!fields.count(expected)) {
        throw CheckpointError(
            where + "parameter " + std::to_string(index) + " has state but no \"state." +
            std::to_string(index) + "." + expected + "\"; it was saved from " +
            "a different optimizer or with other options (amsgrad) than this " + kind_text);
      }
    }
  }

  // Then replace the state, each tensor on its parameter's device, in its dtype and layout.
  torch::NoGradGuard no_grad;
  auto& states = optimizer.state();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& param = params[i].tensor;
    void* key = param.unsafeGetTensorImpl();
    const auto found = per_param.find(static_cast<std::int64_t>(i));
    if (found == per_param.end()) {
      states.erase(key);
      continue;
    }
    const auto like_param = [&](const torch::Tensor& saved) {
      return torch::empty_like(param, torch::MemoryFormat::Preserve).copy_(saved);
    };
    std::unique_ptr<torch::optim::OptimizerParamState> restored;
    if (kind == OptimizerKind::kSGD) {
      auto sgd = std::make_unique<torch::optim::SGDParamState>();
      sgd->momentum_buffer(like_param(found->second.at("momentum_buffer")));
      restored = std::move(sgd);
    } else if (kind == OptimizerKind::kAdam) {
      restored = make_adam_state<torch::optim::AdamParamState>(found->second, like_param);
    } else {
      restored = make_adam_state<torch::optim::AdamWParamState>(found->second, like_param);
    }
    states[key] = std::move(restored);
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    groups[g].options().set_lr(rates.at(static_cast<std::int64_t>(g)));
  }
}

} // namespace flotilla::checkpoint
