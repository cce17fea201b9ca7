#include "flotilla/train/training_state.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

#include "flotilla/base/hashes.h"
#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"
#include "flotilla/train/model.h"

namespace flotilla::train {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string to_hex(const torch::Tensor& bytes) {
  const torch::Tensor b = bytes.contiguous().to(torch::kUInt8);
  return base::to_hex(b.data_ptr<std::uint8_t>(), static_cast<std::size_t>(b.numel()));
}

torch::Tensor from_hex(const std::string& hex) {
  torch::Tensor out = torch::empty({static_cast<std::int64_t>(hex.size() / 2)}, torch::kUInt8);
  auto* p = out.data_ptr<std::uint8_t>();
  auto nibble = [](char c) { return static_cast<std::uint8_t>(c <= '9' ? c - '0' : c - 'a' + 10); };
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    p[i / 2] = static_cast<std::uint8_t>(nibble(hex[i]) << 4 | nibble(hex[i + 1]));
  }
  return out;
}

} // namespace

json to_json(const TrainingState& s) {
  json j = {{"iterations", s.iterations},
            {"epoch", s.epoch},
            {"step_in_epoch", s.step_in_epoch},
            {"loss_scale", s.loss_scale},
            {"loss_scale_good_steps", s.loss_scale_good_steps}};
  if (s.trained_rows >= 0) j["trained_rows"] = s.trained_rows;
  if (s.generation_base > 0) j["generation_base"] = s.generation_base;
  if (!s.training.empty()) j["training"] = s.training;
  if (s.iterator) {
    j["iterator"] = {{"iteration", s.iterator->iteration},
                     {"produced", s.iterator->produced},
                     {"fingerprint", s.iterator->fingerprint}};
    if (s.iterator->in_rows) j["iterator"]["in_rows"] = true;
  }
  return j;
}

TrainingState training_state_from_json(const json& j, const fs::path& where) {
  try {
    TrainingState s;
    s.iterations = j.at("iterations").get<std::int64_t>();
    s.epoch = j.at("epoch").get<int>();
    s.step_in_epoch = j.at("step_in_epoch").get<std::int64_t>();
    s.loss_scale = j.at("loss_scale").get<double>();
    s.loss_scale_good_steps = j.at("loss_scale_good_steps").get<std::int64_t>();
    if (j.contains("iterator")) {
      const json& it = j.at("iterator");
      s.iterator = data::IteratorState{
          it.at("iteration").get<std::int64_t>(), it.at("produced").get<std::int64_t>(),
          it.at("fingerprint").get<std::string>(), it.value("in_rows", false)};
    }
    s.trained_rows = j.value("trained_rows", std::int64_t{-1});
    s.generation_base = std::max<std::int64_t>(0, j.value("generation_base", std::int64_t{0}));
    s.training = j.value("training", std::string());
    return s;
  } catch (const json::exception& e) {
    throw CheckpointError(where.string() + ": the training state in its manifest is incomplete (" +
                          e.what() + "); it was not written by this version of flotilla's fit");
  }
}

namespace {
// This worker's tensors as they are, with `state`, and the CPU generator's state.
checkpoint::CheckpointData local_checkpoint_data(Model& model, const TrainingState& state) {
  checkpoint::CheckpointData data;
  data.model = checkpoint::model_state(model.module());
  data.optimizer = checkpoint::optimizer_state(model.optimizer());
  data.epoch = state.epoch;
  data.step = state.iterations;
  data.policy = to_string(model.policy());
  data.state = to_json(state);
  data.state["rng_cpu"] = to_hex(at::detail::getDefaultCPUGenerator().get_state());
  return data;
}

const std::string kModelPrefix = "model/";
const std::string kOptimizerPrefix = "optimizer/";
} // namespace

json run_identity(Model& model) {
  std::string shapes;
  std::int64_t count = 0;
  for (const auto& item : model.module().named_parameters()) {
    shapes += item.key() + c10::str(item.value().sizes()) + "\n";
    count += item.value().numel();
  }
  std::string name = model.module().name(); // "torch::nn::SequentialImpl": the holder's name
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0)
    name.resize(name.size() - 4);
  return {{"model", name},
          {"parameters", base::sha256_hex(shapes.data(), shapes.size())},
          {"parameter_count", count},
          {"seed", at::detail::getDefaultCPUGenerator().current_seed()},
          {"workers", model.strategy().num_workers()}};
}

checkpoint::CheckpointData checkpoint_data(Model& model) {
  // The replicas' mean, as every worker will read them. Elastic: a collective only the saving
  // chief would join; it saves the buffers it has (mirrored at each epoch's end).
  if (model.strategy().saves_collectively()) model.mirror_buffers();
  checkpoint::CheckpointData data = local_checkpoint_data(model, model.training_state());
  data.state["run"] = run_identity(model);
  return data;
}

TrainingState share_training_state(Model& model, collective::Communicator& comm, int donor,
                                   const TrainingState& state) {
  // Under a cluster token the message carries an HMAC of it: a joiner takes no weights from a
  // process without the token, nor any the wire changed.
  const std::string purpose = "the training state from rank " + std::to_string(donor);
  const std::optional<std::string>& token = comm.options().cluster_token;
  std::string bytes;
  if (comm.rank() == donor) {
    const checkpoint::CheckpointData data = local_checkpoint_data(model, state);
    checkpoint::NamedTensors tensors;
    for (const auto& [name, t] : data.model) tensors.emplace_back(kModelPrefix + name, t);
    for (const auto& [name, t] : data.optimizer) tensors.emplace_back(kOptimizerPrefix + name, t);
    bytes = collective::seal(token, purpose,
                             checkpoint::encode_safetensors(
                                 tensors, {{"state", data.state.dump()}, {"policy", data.policy}}));
  }
  bytes = collective::broadcast_string(comm, bytes, donor);
  if (comm.rank() == donor) return state;
  const std::string& source = purpose;
  const std::optional<std::string> opened =
      collective::open_sealed(token, purpose, std::move(bytes));
  if (!opened) {
    throw CheckpointError(source + " failed its HMAC-SHA256 check under the cluster token: it "
                                   "changed on the way, or came from a process without the "
                                   "token; it is not loaded");
  }
  const checkpoint::SafetensorsFile file = checkpoint::decode_safetensors(*opened, source);
  checkpoint::CheckpointData data;
  for (const auto& [name, t] : file.tensors) {
    if (name.rfind(kModelPrefix, 0) == 0)
      data.model.emplace_back(name.substr(kModelPrefix.size()), t);
    if (name.rfind(kOptimizerPrefix, 0) == 0) {
      data.optimizer.emplace_back(name.substr(kOptimizerPrefix.size()), t);
    }
  }
  const auto state_text = file.metadata.find("state");
  if (state_text == file.metadata.end()) {
    throw CheckpointError(source + " has no training state in its metadata");
  }
  try {
    data.state = json::parse(state_text->second);
  } catch (const json::exception& e) {
    throw CheckpointError(source + " has a malformed training state (" + e.what() + ")");
  }
  return load_checkpoint_data(model, data, source);
}

TrainingState load_checkpoint_data(Model& model, const checkpoint::CheckpointData& data,
                                   const fs::path& where) {
  // Read before anything changes (the loaders below check every name and shape before they
  // copy), so a backup that fails to load leaves the model as it was for the next one.
  TrainingState state = training_state_from_json(data.state, where);
  checkpoint::load_model_state(model.module(), data.model, where.string());
  // Every replica's optimizer: fit() re-syncs the replicas' weights, not their optimizer state.
  for (auto* optimizer : model.optimizers()) {
    checkpoint::load_optimizer_state(*optimizer, data.optimizer);
  }
  if (data.state.contains("rng_cpu")) {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(from_hex(data.state.at("rng_cpu").get<std::string>()));
  }
  return state;
}

// ---------------------------------------------------------------------------------------------
// Model::save and Model::load (here: they are checkpoint_data and load_checkpoint_data's users).

namespace {
constexpr const char* kSavePrefix = "model";
} // namespace

std::filesystem::path Model::save(const std::filesystem::path& directory) {
  require_compiled("save");
  collective::Communicator* const group = strategy_.saving_group();
  if (!group) return {};
  checkpoint::CheckpointManager manager(directory, /*max_to_keep=*/1, kSavePrefix);
  return manager.save(*group, strategy_.log(), checkpoint_data(*this), iterations());
}

void Model::load(const std::filesystem::path& directory) {
  require_compiled("load");
  const checkpoint::CheckpointManager manager(directory, /*max_to_keep=*/1, kSavePrefix);
  const std::optional<std::filesystem::path> latest = manager.latest();
  if (!latest) {
    throw CheckpointError(directory.string() + ": no saved model here (no \"checkpoint\" pointer "
                                               "file); give the directory Model::save wrote");
  }
  const checkpoint::CheckpointData data =
      checkpoint::read_checkpoint(*latest, strategy_.communicator().options().checkpoint_key);
  const nlohmann::json mine = run_identity(*this);
  if (data.state.contains("run") &&
      data.state.at("run").value("parameters", "") != mine.value("parameters", "")) {
    throw CheckpointError(latest->string() + ": saved from another model (" +
                          data.state.at("run").value("model", std::string("?")) +
                          ", other parameter names or shapes than this " +
                          mine.value("model", std::string("?")) +
                          "); load it into the model it was saved from");
  }
  const TrainingState saved = load_checkpoint_data(*this, data, *latest);
  TrainingState state;
  state.iterations = saved.iterations;
  state.trained_rows = saved.trained_rows;
  state.loss_scale = saved.loss_scale;
  state.loss_scale_good_steps = saved.loss_scale_good_steps;
  restore_training_state(state);
}

} // namespace flotilla::train
