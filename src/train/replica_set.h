// Private: a worker's replicas of the model. Replica 0 is the model itself; compile() clones the
// others onto their devices. Each replica has its own optimizer (all take the same step on the
// same averaged gradients); replicas 1..K-1 run on threads that live as long as the set, so a
// step costs K-1 hand-offs, not K-1 thread starts.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <vector>

#include "flotilla/collective/communicator.h"
#include "flotilla/train/model.h"

namespace flotilla::train::detail {

class ReplicaSet {
 public:
  // `first` moves to devices[0]; `clone` makes each other replica, moved to its device.
  // `channels_last`: every replica's 4-D parameters and buffers are kept channels-last (NHWC in
  // memory, the same NCHW shape), and so is a 4-D input its forward gets (free for one channel:
  // that layout is both); otherwise they are made contiguous (NCHW).
  // ConfigError when several replicas are asked for without a clone function, or when the model
  // sits on a GPU the CPU replicas cannot use.
  ReplicaSet(const std::vector<torch::Device>& devices, Model::MultiReplica first,
             const std::function<Model::MultiReplica()>& clone, const OptimizerOptions& optimizer,
             bool channels_last);
  ~ReplicaSet();

  int size() const { return static_cast<int>(replicas_.size()); }
  torch::nn::Module& module(int r) const { return *replicas_[static_cast<std::size_t>(r)].first; }
  const Model::MultiForward& forward(int r) const {
    return replicas_[static_cast<std::size_t>(r)].second;
  }
  const torch::Device& device(int r) const { return devices_[static_cast<std::size_t>(r)]; }
  const std::vector<torch::Device>& devices() const { return devices_; }
  std::vector<std::shared_ptr<torch::nn::Module>> modules() const;
  std::vector<torch::optim::Optimizer*> optimizers() const;

  // fn(r) for every replica at once, replica 0 on the calling thread; rethrows the first
  // replica's failure after all have finished.
  void run(const std::function<void(int)>& fn);
  // Replica 0's parameters and buffers into the others: weights loaded into the model since
  // compile() (a checkpoint, a backup, a user's edit) reach every replica. ConfigError when the
  // model's tensors changed since compile().
  void copy_first_to_others();
  // Every replica's buffers become the mean over every replica of every worker (`workers`):
  // floating ones averaged, integer ones (num_batches_tracked) the largest. One all-reduce per
  // kind of buffer; every worker calls it. Bit-identical everywhere afterwards.
  // `weight`: this worker's share of each global batch (shares by speed), its replicas' mean
  // weighing that much in the mean over workers; 0: every replica weighs the same.
  void mirror_buffers(collective::Communicator& workers, double weight = 0);
  void set_training(bool training);
  // Every replica's optimizer steps, its first parameter group at `learning_rate` and every
  // other at its ratio to the first as the optimizer was built (one group for the built-ins).
  void step(double learning_rate);
  // The first group's learning rate as OptimizerOptions::custom built it.
  double built_learning_rate() const {
    return optimizers_.front()->param_groups().front().options().get_lr();
  }
  // Scales every replica's gradients so that their global L2 norm is at most `max_norm`
  // (clip_grad_norm_). The replicas hold the same all-reduced gradients; each computes the norm
  // itself, so they stay bit-identical (a factor computed once and applied to the others could
  // round differently from clip_grad_norm_'s own).
  void clip_gradients(double max_norm);

 private:
  struct Threads;
  std::vector<Model::MultiReplica> replicas_;
  std::vector<torch::Device> devices_;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers_;
  std::vector<double> learning_rate_ratios_; // each group's rate over the first's, as built
  std::unique_ptr<Threads> threads_;
};

// Whether `module` has 4-D parameters (2-D convolutions), whose kernels run faster on NHWC.
bool has_convolutions(const torch::nn::Module& module);

} // namespace flotilla::train::detail
