#include "flotilla/data/sharded_dataset.h"

#include <ATen/CPUGeneratorImpl.h>

#include "flotilla/error.h"

namespace flotilla::data {

ShardedDataset::ShardedDataset(torch::Tensor features, torch::Tensor labels,
                               strategy::InputContext context, ShardOptions options,
                               Transform transform)
    : features_(std::move(features)), labels_(std::move(labels)), context_(context),
      options_(options), transform_(std::move(transform)),
      per_replica_batch_(context.get_per_replica_batch_size(options.global_batch)) {
  if (features_.size(0) != labels_.size(0)) {
    throw DataError("features hold " + std::to_string(features_.size(0)) + " examples but labels " +
                    std::to_string(labels_.size(0)) + "; give one label per example");
  }
  if (options_.drop_remainder && size() < options_.global_batch) {
    throw ConfigError(
        "the dataset has " + std::to_string(size()) + " examples, fewer than one global batch of " +
        std::to_string(options_.global_batch) + " with drop_remainder: lower the batch size");
  }
  set_epoch(0);
}

std::int64_t ShardedDataset::steps_per_epoch() const {
  const auto g = options_.global_batch;
  return options_.drop_remainder ? size() / g : (size() + g - 1) / g;
}

void ShardedDataset::set_epoch(std::int64_t epoch) {
  if (!options_.shuffle) {
    order_ = torch::arange(size(), torch::kInt64);
    return;
  }
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed + epoch);
  order_ = torch::randperm(size(), generator, torch::kInt64);
}

Batch ShardedDataset::batch(std::int64_t step) const {
  if (step < 0 || step >= steps_per_epoch()) {
    throw ConfigError("step " + std::to_string(step) + " is out of range: an epoch has " +
                      std::to_string(steps_per_epoch()) + " steps");
  }
  const std::int64_t begin = step * options_.global_batch + context_.input_pipeline_id;
  const std::int64_t end = std::min(size(), (step + 1) * options_.global_batch);
  torch::Tensor index = order_.slice(0, begin, end, context_.num_input_pipelines);
  torch::Tensor features = features_.index_select(0, index);
  return {transform_ ? transform_(features) : features, labels_.index_select(0, index)};
}

} // namespace flotilla::data
