#include "train/evaluation.h"

#include <algorithm>
#include <functional>
#include <numeric>

#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"
#include "train/captured_step.h"
#include "train/replica_set.h"
#include "train/train_step.h"

namespace flotilla::train::detail {

namespace {
// Each worker's outputs and rows per batch, gathered, then each batch's rows in worker order.
torch::Tensor in_dataset_order(collective::Communicator& workers, const torch::Tensor& mine,
                               const std::vector<std::int64_t>& rows, bool predicted) {
  const auto flat = collective::all_gather_uneven(workers, mine.reshape({-1}));
  const auto counts = collective::all_gather_uneven(workers, torch::tensor(rows, torch::kLong));
  // A row's shape, from a worker that has one (this one may have predicted nothing).
  const auto shapes = collective::all_gather_uneven(
      workers, predicted ? torch::tensor(mine.sizes().slice(1).vec(), torch::kLong)
                         : torch::empty({0}, torch::kLong));
  // Worker w's rows per batch (host integers), then each batch's rows in worker order.
  std::vector<std::vector<std::int64_t>> rows_of;
  std::vector<std::int64_t> full_shape;
  std::int64_t batches = 0;
  for (std::size_t w = 0; w < counts.size(); ++w) {
    const std::int64_t* r = counts[w].data_ptr<std::int64_t>();
    rows_of.emplace_back(r, r + counts[w].numel());
    batches = std::max(batches, counts[w].numel());
    if (full_shape.empty() && std::accumulate(rows_of[w].begin(), rows_of[w].end(), 0LL) > 0) {
      const std::int64_t* d = shapes[w].data_ptr<std::int64_t>();
      full_shape.assign({-1});
      full_shape.insert(full_shape.end(), d, d + shapes[w].numel());
    }
  }
  if (full_shape.empty()) return mine; // no worker predicted anything
  const std::int64_t row_numel = std::accumulate(full_shape.begin() + 1, full_shape.end(), 1LL,
                                                 std::multiplies<std::int64_t>());
  std::vector<torch::Tensor> ordered;
  std::vector<std::int64_t> cursor(flat.size(), 0);
  for (std::int64_t b = 0; b < batches; ++b) {
    for (std::size_t w = 0; w < flat.size(); ++w) {
      const auto& r = rows_of[w];
      if (b >= static_cast<std::int64_t>(r.size()) || r[b] == 0) continue;
      ordered.push_back(flat[w].narrow(0, cursor[w] * row_numel, r[b] * row_numel));
      cursor[w] += r[b];
    }
  }
  return torch::cat(ordered).view(full_shape);
}
} // namespace

EvalResult evaluate_pass(const TrainStep& step, const data::DistributedDataset& data) {
  const Model::Forward& forward = step.model_forward();
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(step.replicas().module(0));
  const torch::Device device = step.device(); // the model itself is replica 0
  torch::Tensor sums = step.zero_sums();
  auto pass = data.make_iterator();
  while (auto batch = pass.next()) {
    check_element(batch->element);
    data::Element e;
    for (const auto& t : batch->element) {
      e.push_back(on_device(t, device));
      // On the side stream inside fit().
      if (step.captured()) use_on_current_stream(e.back());
    }
    if (e[1].size(0) == 0) continue; // this worker's share of a short last batch
    torch::Tensor outputs;
    {
      AutocastGuard autocast(step.policy(), device.type());
      outputs = forward(e[0]);
    }
    sums.add_(step.batch_sums(step.per_example(outputs, e), outputs, e[1]));
  }
  const torch::Tensor global =
      step.strategy().reduce(strategy::ReduceOp::kSum, sums.to(torch::kCPU));
  const std::vector<double> g = to_host(global);
  EvalResult result;
  const double count = g.back();
  result.samples = static_cast<std::int64_t>(count);
  step.set_means(result.values, g.data(), count > 0 ? count : 1);
  return result;
}

torch::Tensor predict_pass(const TrainStep& step, const data::DistributedDataset& data) {
  const Model::Forward& forward = step.model_forward();
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(step.replicas().module(0));
  const torch::Device device = step.device();
  std::vector<torch::Tensor> outputs; // this worker's, float32 on the CPU
  std::vector<std::int64_t> rows;     // per batch
  auto pass = data.make_iterator();
  while (auto batch = pass.next()) {
    if (batch->element.empty()) throw DataError("predict: a batch has no components");
    const torch::Tensor features = on_device(batch->element[0], device);
    rows.push_back(features.dim() > 0 ? features.size(0) : 0);
    if (rows.back() == 0) continue; // this worker's share of a short last batch
    torch::Tensor y;
    {
      AutocastGuard autocast(step.policy(), device.type());
      y = forward(features);
    }
    outputs.push_back(y.to(torch::kCPU, torch::kFloat32).contiguous());
  }
  const torch::Tensor mine = outputs.empty() ? torch::empty({0}) : torch::cat(outputs);
  auto& workers = step.strategy().communicator();
  if (workers.size() == 1) return mine;
  return in_dataset_order(workers, mine, rows, !outputs.empty());
}

} // namespace flotilla::train::detail
