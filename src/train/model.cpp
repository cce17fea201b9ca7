// Model is a facade: compile() builds the train step (train_step.h) and the healer (healer.h),
// fit() runs a fit loop (fit_loop.h) over them, evaluate() and predict() the passes of
// evaluation.h. What callbacks read (iterations, the epoch, the training state) is asked of the
// step and the fit's progress.
#include "flotilla/train/model.h"

#include <utility>

#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "flotilla/train/callback.h"
#include "train/epoch_iterator.h"
#include "train/evaluation.h"
#include "train/fit_loop.h"
#include "train/fit_progress.h"
#include "train/healer.h"
#include "train/replica_set.h"
#include "train/step_timer.h"
#include "train/train_step.h"

namespace flotilla::train {

namespace {

Model::MultiForward of_one(Model::Forward forward) {
  if (!forward) return {};
  return
      [forward = std::move(forward)](const Tensors& inputs) { return Tensors{forward(inputs[0])}; };
}

} // namespace

Model::Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
             Forward forward, std::function<Replica()> clone)
    : Model(strategy, std::move(module), of_one(std::move(forward)), Signature{},
            clone ? std::function<MultiReplica()>([clone = std::move(clone)] {
              auto [module, forward] = clone();
              return MultiReplica{std::move(module), of_one(std::move(forward))};
            })
                  : std::function<MultiReplica()>{}) {}

Model::Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
             MultiForward forward, Signature signature, std::function<MultiReplica()> clone)
    : strategy_(strategy), module_(std::move(module)), forward_(std::move(forward)),
      signature_(signature), clone_(std::move(clone)),
      timer_(std::make_unique<detail::StepTimer>()),
      progress_(std::make_unique<detail::FitProgress>()) {
  if (!module_ || !forward_) throw ConfigError("Model needs a module and its forward function");
  if (signature_.inputs < 1 || signature_.outputs < 1) {
    throw ConfigError("a model's Signature needs at least 1 input and 1 output; saw " +
                      std::to_string(signature_.inputs) + " and " +
                      std::to_string(signature_.outputs));
  }
}

Model::~Model() = default;

void Model::set_step_tracing(bool on, std::int64_t max_steps) {
  if (on && max_steps < 1) {
    throw ConfigError("step tracing needs max_steps >= 1; saw " + std::to_string(max_steps));
  }
  timer_->set_tracing(on, max_steps);
}

std::vector<StepTrace> Model::take_step_traces() {
  return timer_->take_traces();
}

void Model::compile(const CompileOptions& options) {
  // Until this compile succeeds the model is not compiled; the old step's gradient engine
  // (its hooks sit on the replicas being replaced) goes first.
  healer_.reset();
  step_.reset();
  resume_.reset();
  step_ =
      std::make_unique<detail::TrainStep>(strategy_, MultiReplica{module_, forward_}, signature_,
                                          clone_, options, global_policy(), *timer_);
  healer_ = std::make_unique<detail::Healer>(
      strategy_, *step_, *progress_, stop_training,
      [this](collective::Communicator& comm, int donor, const TrainingState& mine) {
        return share_training_state(*this, comm, donor, mine);
      });
}

void Model::require_single(const char* what) const {
  if (signature_.inputs != 1 || signature_.outputs != 1) {
    throw ConfigError(std::string("Model.") + what +
                      "() gives one output for one input; this "
                      "model has " +
                      std::to_string(signature_.inputs) + " inputs and " +
                      std::to_string(signature_.outputs) + " outputs: use predict_outputs()");
  }
}

void Model::require_compiled(const char* what) const {
  if (!step_) {
    throw ConfigError(std::string("Model.") + what + "() before compile(); call compile() first");
  }
}

const strategy::GradientReducer& Model::gradient_reducer() const {
  require_compiled("gradient_reducer");
  return step_->reducer();
}

const CompileOptions& Model::compile_options() const {
  require_compiled("compile_options");
  return step_->options();
}

std::vector<std::shared_ptr<torch::nn::Module>> Model::local_replicas() const {
  require_compiled("local_replicas");
  return step_->replicas().modules();
}

torch::optim::Optimizer& Model::optimizer() {
  require_compiled("optimizer");
  return *step_->replicas().optimizers().front();
}

std::vector<torch::optim::Optimizer*> Model::optimizers() {
  require_compiled("optimizers");
  return step_->replicas().optimizers();
}

double Model::learning_rate() const {
  require_compiled("learning_rate");
  return step_->learning_rate();
}

void Model::set_learning_rate(double learning_rate) {
  require_compiled("set_learning_rate");
  step_->set_learning_rate(learning_rate);
}

Policy Model::policy() const {
  return step_ ? step_->policy() : Policy::kFloat32;
}

bool Model::channels_last() const {
  return step_ && step_->channels_last();
}

const kernels::CompileReport* Model::kernel_rewrites() const {
  return step_ ? step_->kernel_rewrites() : nullptr;
}

bool Model::last_step_finite() const {
  return !step_ || step_->last_step_finite();
}

std::int64_t Model::iterations() const {
  return step_ ? step_->iterations() : 0;
}

int Model::current_epoch() const {
  return progress_->epoch;
}

TrainingState Model::training_state() const {
  return progress_->state(step_.get(), /*with_position=*/true);
}

std::int64_t Model::generation() const {
  const auto* group = strategy_.elastic();
  if (!group) return -1;
  return (step_ ? step_->generation_base() : 0) + static_cast<std::int64_t>(group->generation());
}

std::string Model::training_id() const {
  return step_ ? step_->training() : std::string();
}

void Model::restore_training_state(const TrainingState& state) {
  require_compiled("restore_training_state");
  step_->restore_counters(state);
  resume_ = state;
}

History Model::fit(const data::Dataset& train, const FitOptions& options) {
  return fit(data::distribute_dataset(train, strategy_.input_context()), options);
}

History Model::fit(const data::DistributedDataset& train, const FitOptions& options) {
  require_compiled("fit");
  CallbackList callbacks(options.callbacks, options.verbose);
  detail::FitLoop loop(strategy_, *step_, *healer_, *progress_, *timer_, callbacks, options,
                       stop_training, preemption_requested_);
  return loop.run(
      train, [&](const TrainParams& params) { callbacks.set_model(this, params); }, resume_);
}

void Model::mirror_buffers() {
  require_compiled("mirror_buffers");
  step_->mirror_buffers();
}

template <class Result>
Result Model::collective_pass(const data::DistributedDataset& data,
                              const std::function<Result(const data::DistributedDataset&)>& pass) {
  if (!healer_->elastic() || progress_->input) { // inside fit, fit heals
    mirror_buffers();
    return pass(data);
  }
  // Elastic, outside fit: a member's failure heals, and the pass runs again on the data split
  // among the workers there are.
  std::optional<Result> result;
  while (!healer_->attempt(
      [&] {
        mirror_buffers();
        result = pass(data.redistribute(detail::evaluation_context(strategy_)));
      },
      nullptr)) {
  }
  return std::move(*result);
}

EvalResult Model::evaluate(const data::Dataset& data) {
  return evaluate(data::distribute_dataset(data, detail::evaluation_context(strategy_)));
}

EvalResult Model::evaluate(const data::DistributedDataset& data) {
  require_compiled("evaluate");
  return collective_pass<EvalResult>(
      data, [this](const data::DistributedDataset& d) { return detail::evaluate_pass(*step_, d); });
}

torch::Tensor Model::predict(const data::Dataset& data) {
  require_single("predict");
  return predict_outputs(data).front();
}

torch::Tensor Model::predict(const data::DistributedDataset& data) {
  require_single("predict");
  return predict_outputs(data).front();
}

torch::Tensor Model::predict(const torch::Tensor& features) {
  require_single("predict");
  return predict_outputs(Tensors{features}).front();
}

Tensors Model::predict_outputs(const data::Dataset& data) {
  return predict_outputs(data::distribute_dataset(data, detail::evaluation_context(strategy_)));
}

Tensors Model::predict_outputs(const data::DistributedDataset& data) {
  require_compiled("predict");
  return collective_pass<Tensors>(
      data, [this](const data::DistributedDataset& d) { return detail::predict_pass(*step_, d); });
}

Tensors Model::predict_outputs(const Tensors& inputs) {
  if (static_cast<int>(inputs.size()) != signature_.inputs) {
    throw ConfigError("predict_outputs: this model takes " + std::to_string(signature_.inputs) +
                      " inputs; saw " + std::to_string(inputs.size()));
  }
  torch::NoGradGuard no_grad;
  detail::EvalMode eval_mode(*module_);
  const torch::Device device = step_ ? step_->device() : inputs[0].device();
  const Policy policy = this->policy();
  Tensors on_device;
  for (const auto& x : inputs) on_device.push_back(detail::on_device(x, device));
  Tensors outputs;
  {
    AutocastGuard autocast(policy, device.type());
    outputs = forward_(on_device);
  }
  detail::check_outputs(outputs, signature_);
  // On the caller's device, as given.
  for (auto& y : outputs) {
    y = (policy == Policy::kFloat32 ? y : y.to(torch::kFloat32)).to(inputs[0].device());
  }
  return outputs;
}

} // namespace flotilla::train
