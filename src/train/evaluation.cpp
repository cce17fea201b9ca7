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
// Each worker's outputs gathered, then each batch's rows in worker order; `counts`: every
// worker's rows per batch (gathered once for all the outputs).
torch::Tensor in_dataset_order(collective::Communicator& workers, const torch::Tensor& mine,
                               const std::vector<torch::Tensor>& counts, bool predicted) {
  const auto flat = collective::all_gather_uneven(workers, mine.reshape({-1}));
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
  const Signature& signature = step.signature();
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(step.replicas().module(0));
  const torch::Device device = step.device(); // the model itself is replica 0
  torch::Tensor sums = step.zero_sums();
  auto pass = data.make_iterator();
  while (auto batch = pass.next()) {
    check_element(batch->element, signature);
    data::Element e;
    for (const auto& t : batch->element) {
      e.push_back(on_device(t, device));
      // On the side stream inside fit().
      if (step.captured()) use_on_current_stream(e.back());
    }
    if (rows_of(e, signature) == 0) continue; // this worker's share of a short last batch
    const Tensors outputs = step.forward(-1, e);
    sums.add_(step.batch_sums(step.per_example(outputs, e), outputs, e));
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

Tensors predict_pass(const TrainStep& step, const data::DistributedDataset& data) {
  const Signature& signature = step.signature();
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(step.replicas().module(0));
  const torch::Device device = step.device();
  // This worker's outputs, float32 on the CPU: per output, per batch.
  std::vector<Tensors> outputs(static_cast<std::size_t>(signature.outputs));
  std::vector<std::int64_t> rows; // per batch
  auto pass = data.make_iterator();
  while (auto batch = pass.next()) {
    if (static_cast<int>(batch->element.size()) < signature.inputs) {
      throw DataError("predict: a batch has " + std::to_string(batch->element.size()) +
                      " components; the model takes " + std::to_string(signature.inputs) +
                      " inputs");
    }
    data::Element e;
    for (int i = 0; i < signature.inputs; ++i) e.push_back(on_device(batch->element[i], device));
    rows.push_back(e[0].dim() > 0 ? e[0].size(0) : 0);
    if (rows.back() == 0) continue; // this worker's share of a short last batch
    const Tensors y = step.forward(-1, e);
    for (std::size_t o = 0; o < y.size(); ++o) {
      outputs[o].push_back(y[o].to(torch::kCPU, torch::kFloat32).contiguous());
    }
  }
  auto& workers = step.strategy().communicator();
  std::vector<torch::Tensor> counts;
  if (workers.size() > 1) {
    counts = collective::all_gather_uneven(workers, torch::tensor(rows, torch::kLong));
  }
  Tensors all;
  for (const auto& per_batch : outputs) {
    const torch::Tensor mine = per_batch.empty() ? torch::empty({0}) : torch::cat(per_batch);
    all.push_back(workers.size() == 1
                      ? mine
                      : in_dataset_order(workers, mine, counts, !per_batch.empty()));
  }
  return all;
}

} // namespace flotilla::train::detail
