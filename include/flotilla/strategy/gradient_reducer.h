// Averages gradients across replicas every step. Gradients are packed, in reverse registration
// order (roughly the order backward produces them), into flat buckets of at most bytes_per_pack
// bytes; each bucket is one asynchronous all-reduce, all in flight together. This is the plain
// engine: pack after backward, reduce, unpack. An overlapped engine (reduction started from
// autograd hooks while backward runs) keeps this interface: prepare() before backward,
// finish() before the optimizer.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "flotilla/collective/communicator.h"

namespace flotilla::strategy {

class GradientReducer {
 public:
  struct Bucket {
    std::vector<std::size_t> params;   // indices into the parameter list
    std::vector<std::int64_t> offsets; // element offset of each parameter in `flat`
    std::int64_t numel = 0;            // gradient elements; then one used-flag per parameter
    torch::Tensor flat;
  };

  GradientReducer(collective::Communicator communicator, std::vector<torch::Tensor> parameters,
                  std::int64_t bytes_per_pack);

  void prepare() {} // nothing to arm in the plain engine
  // Replaces every parameter's gradient with its mean over all replicas. A parameter that got
  // no gradient on this replica contributes zeros (others may have used it), so no replica
  // waits for a gradient that never comes; one that got none on any replica keeps none.
  void finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }

 private:
  collective::Communicator communicator_;
  std::vector<torch::Tensor> parameters_;
  std::vector<Bucket> buckets_;
};

} // namespace flotilla::strategy
