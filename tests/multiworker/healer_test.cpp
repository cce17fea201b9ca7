// Model::fit's healer against a fake elastic group: the test forms the generations itself, over
// in-memory stores and thread ranks, where the real group (collective::ElasticGroup::join) forms
// them through the rendezvous. A departure fails every operation of the generation with
// GroupChanged, as the rendezvous's notice does; the healer regroups, reconciles and goes on. A
// worker waiting to join is admitted when the members vote for it at a step boundary, and takes
// a member's training state.
// No process, heartbeat or timeout is involved (ElasticFit.* covers those with real processes).
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/nn.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collective/group.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "flotilla/train/callback.h"
#include "flotilla/train/model.h"
#include "support/ranks.h"

namespace flotilla {
namespace {

using testing::thread_cluster;

// The generations of a group of thread ranks, as the test decides them.
class FakeRendezvous {
 public:
  struct Generation {
    std::uint64_t number = 0;
    std::vector<int> slots;
    c10::intrusive_ptr<c10d::Store> store;
    std::shared_ptr<collective::Health> health;
    std::string reason;
  };

  explicit FakeRendezvous(int slots) {
    std::vector<int> all(static_cast<std::size_t>(slots));
    for (int s = 0; s < slots; ++s) all[static_cast<std::size_t>(s)] = s;
    form(all, "all " + std::to_string(slots) + " workers joined");
  }
  // Generation 0 of these slots only; the others may join later (wait_to_join).
  explicit FakeRendezvous(const std::vector<int>& first) { form(first, "the first workers"); }

  // `slot` (a restarted worker) waits to be admitted; the members learn it from waiting().
  void wait_to_join(int slot) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_.push_back(slot);
  }
  int waiting() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int>(waiting_.size());
  }
  // The members of `current`, together at a step boundary, admit whoever waits: the first to
  // ask forms the next generation, the others find it formed. False when none waited.
  bool admit(std::uint64_t current) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (generations_.size() > current + 1) return true;
    if (waiting_.empty()) return false;
    std::vector<int> slots = generations_.back().slots;
    slots.insert(slots.end(), waiting_.begin(), waiting_.end());
    std::sort(slots.begin(), slots.end());
    waiting_.clear();
    form_locked(slots, "admitted the waiting workers");
    changed_.notify_all();
    return true;
  }
  // The first generation that lists `slot`, once there is one.
  Generation with(int slot) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto lists = [&] {
      const auto& s = generations_.back().slots;
      return std::find(s.begin(), s.end(), slot) != s.end();
    };
    changed_.wait(lock, lists);
    return generations_.back();
  }

  // `slot` leaves: the next generation forms from the others, and every operation of the
  // current one fails with GroupChanged, as the rendezvous's notice makes it.
  void leave(int slot) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int> rest = generations_.back().slots;
    rest.erase(std::remove(rest.begin(), rest.end(), slot), rest.end());
    const auto failed = generations_.back().health;
    form_locked(rest, "slot " + std::to_string(slot) + " left the group");
    collective::detail::fail_group(*failed, "slot " + std::to_string(slot) + " left the group",
                                   /*changed=*/true);
    changed_.notify_all();
  }

  Generation at(std::uint64_t number) {
    std::lock_guard<std::mutex> lock(mutex_);
    return generations_.at(number);
  }
  // The newest generation after `current`, once there is one.
  Generation after(std::uint64_t current) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return generations_.size() > current + 1; });
    return generations_.back();
  }

 private:
  void form(const std::vector<int>& slots, const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    form_locked(slots, reason);
  }
  void form_locked(const std::vector<int>& slots, const std::string& reason) {
    Generation g;
    g.number = generations_.size();
    g.slots = slots;
    g.store = c10::make_intrusive<c10d::HashStore>();
    g.health = collective::detail::new_health();
    g.reason = reason;
    generations_.push_back(std::move(g));
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Generation> generations_;
  std::vector<int> waiting_;
};

// One slot's membership of the fake group: collective::ElasticGroup's interface, which is all
// the healer sees of the real one.
class FakeGroup : public collective::ElasticGroup {
 public:
  FakeGroup(FakeRendezvous& rendezvous, int slot) : rendezvous_(rendezvous), slot_(slot) {
    adopt(rendezvous_.at(0));
  }
  // A restarted worker: blocks until a generation admits it; it joins a running training.
  struct Joining {};
  FakeGroup(FakeRendezvous& rendezvous, int slot, Joining)
      : rendezvous_(rendezvous), slot_(slot), afresh_(false) {
    adopt(rendezvous_.with(slot)); // the test put it in the waiting list (wait_to_join)
  }
  collective::Communicator& communicator() override { return *communicator_; }
  std::uint64_t generation() const override { return generation_.number; }
  const std::vector<int>& members() const override { return generation_.slots; }
  int slot() const override { return slot_; }
  const std::string& reason() const override { return generation_.reason; }
  int waiting() const override { return rendezvous_.waiting(); }
  bool starts_afresh() const override { return afresh_; }
  void training_finished() override {}
  void regroup() override {
    ++regroups;
    adopt(rendezvous_.after(generation_.number));
  }
  // Its threads never stop, so nobody is expelled behind its back.
  void confirm_membership() override {}
  bool admit() override {
    if (!rendezvous_.admit(generation_.number)) return false;
    ++admissions;
    adopt(rendezvous_.after(generation_.number));
    return true;
  }

  int regroups = 0;
  int admissions = 0;

 private:
  void adopt(FakeRendezvous::Generation g) {
    const auto it = std::find(g.slots.begin(), g.slots.end(), slot_);
    if (it == g.slots.end()) throw CommError("slot " + std::to_string(slot_) + " was expelled");
    const int rank = static_cast<int>(it - g.slots.begin());
    const int size = static_cast<int>(g.slots.size());
    std::vector<std::string> names;
    for (int s : g.slots) names.push_back("slot " + std::to_string(s));
    communicator_ = std::make_unique<collective::Communicator>(collective::detail::make_group(
        rank, size, testing::test_options(), g.store, "127.0.0.1", names, g.health));
    generation_ = std::move(g);
  }

  FakeRendezvous& rendezvous_;
  int slot_;
  bool afresh_ = true;
  FakeRendezvous::Generation generation_;
  std::unique_ptr<collective::Communicator> communicator_;
};

std::mutex build_mutex; // ranks are threads sharing torch's generator

torch::nn::Sequential make_net() {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 3));
}

// 72 rows: 2 epochs of 6 global batches of 12.
data::Dataset rows() {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(11);
  const auto x = torch::randn({72, 8});
  const auto y = torch::randint(0, 3, {72});
  return data::Dataset::from_tensor_slices({x, y}).batch(12);
}

torch::Tensor flat(const torch::nn::Sequential& net) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : net->parameters()) parts.push_back(p.detach().flatten());
  return torch::cat(parts);
}

train::CompileOptions sgd() {
  train::CompileOptions compile;
  compile.optimizer = train::OptimizerOptions::sgd(0.1, 0.9);
  return compile;
}

// Slot `slot` leaves at this step of this epoch (before it), as a killed worker would.
class LeaveAt : public train::Callback {
 public:
  LeaveAt(FakeRendezvous& rendezvous, int slot, int epoch, std::int64_t step)
      : rendezvous_(rendezvous), slot_(slot), epoch_(epoch), step_(step) {}
  void on_epoch_begin(int epoch) override { epoch_now_ = epoch; }
  void on_train_batch_begin(std::int64_t batch) override {
    if (epoch_now_ != epoch_ || batch != step_) return;
    rendezvous_.leave(slot_);
    throw Error("slot " + std::to_string(slot_) + " is gone"); // not a departure to heal
  }

 private:
  FakeRendezvous& rendezvous_;
  int slot_, epoch_;
  std::int64_t step_;
  int epoch_now_ = -1;
};

train::FitOptions two_epochs() {
  train::FitOptions fit;
  fit.epochs = 2;
  fit.verbose = train::Verbosity::kSilent;
  return fit;
}

// The fault-free run: a fixed group of `slots`; its weights at the end.
torch::Tensor fault_free(int slots) {
  torch::Tensor weights;
  testing::run_ranks(slots, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, slots), comm);
    auto net = s.scope(make_net);
    train::Model model(s, net);
    model.compile(sgd());
    model.fit(rows(), two_epochs());
    if (rank == 0) weights = flat(net);
  });
  return weights;
}

// What one slot's elastic fit ended with.
struct SlotRun {
  torch::Tensor weights;
  std::int64_t updates = -1;
  int regroups = -1, admissions = -1, workers = -1;
  std::string error; // what it threw, if it did
};

// Every slot fits two epochs in a thread of its own, on the fake group `group_of(slot)`, with
// the callbacks `callbacks_of(slot)` (if given) added.
std::vector<SlotRun> elastic_fit(
    int slots, const std::function<std::shared_ptr<FakeGroup>(int)>& group_of,
    const std::function<std::vector<std::shared_ptr<train::Callback>>(int)>& callbacks_of = {}) {
  std::vector<SlotRun> runs(static_cast<std::size_t>(slots));
  std::vector<std::thread> threads;
  for (int slot = 0; slot < slots; ++slot) {
    threads.emplace_back([&, slot] {
      SlotRun& run = runs[static_cast<std::size_t>(slot)];
      try {
        auto group = group_of(slot);
        strategy::Strategy s(thread_cluster(slot, slots), group, {torch::Device(torch::kCPU)},
                             strategy::ElasticOptions::Batch::kGlobal);
        auto net = s.scope(make_net);
        train::Model model(s, net);
        model.compile(sgd());
        train::FitOptions options = two_epochs();
        if (callbacks_of) {
          for (auto& c : callbacks_of(slot)) options.callbacks.push_back(c);
        }
        model.fit(rows(), options);
        run.weights = flat(net);
        run.updates = model.iterations();
        run.regroups = group->regroups;
        run.admissions = group->admissions;
        run.workers = s.num_workers();
      } catch (const std::exception& e) {
        run.error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return runs;
}

TEST(Healer, AMemberLeavingMidFitIsHealedAroundAndTheOthersEndAsAFaultFreeRunDoes) {
  constexpr int kSlots = 3;
  const torch::Tensor reference = fault_free(kSlots);

  // The elastic run: slot 2 leaves before step 3 of epoch 1 (the second epoch).
  FakeRendezvous rendezvous(kSlots);
  const auto runs = elastic_fit(
      kSlots, [&](int slot) { return std::make_shared<FakeGroup>(rendezvous, slot); },
      [&](int slot) {
        std::vector<std::shared_ptr<train::Callback>> callbacks;
        if (slot == 2) callbacks.push_back(std::make_shared<LeaveAt>(rendezvous, 2, 1, 3));
        return callbacks;
      });

  EXPECT_EQ(runs[2].error, "slot 2 is gone");
  for (int slot : {0, 1}) {
    const SlotRun& run = runs[static_cast<std::size_t>(slot)];
    ASSERT_EQ(run.error, "") << "slot " << slot;
    EXPECT_EQ(run.regroups, 1) << "slot " << slot; // one heal, from generation 0 to 1
    EXPECT_EQ(run.workers, 2) << "slot " << slot;
    EXPECT_EQ(run.updates, 12) << "slot " << slot; // the failed step redone, none lost or added
  }
  EXPECT_TRUE(torch::equal(runs[0].weights, runs[1].weights));
  // The global batch stayed 12 rows (6 per survivor instead of 4 per member): the same updates as
  // the fault-free run, summed in another order.
  EXPECT_LT((runs[0].weights - reference).abs().max().item<double>(), 1e-5);
  // Control: the run did move the weights, so the closeness above says something.
  EXPECT_GT((reference - flat(make_net())).abs().max().item<double>(), 1e-2);
}

TEST(Healer, AWorkerWaitingToJoinIsAdmittedAtAStepBoundaryAndTakesAMembersState) {
  constexpr int kSlots = 3;
  const torch::Tensor reference = fault_free(kSlots);

  // Slots 0 and 1 start; slot 2 (a restarted worker) waits from the start. The members vote on
  // admitting at a step boundary every 8 updates, and read the vote at the next boundary.
  FakeRendezvous rendezvous(std::vector<int>{0, 1});
  rendezvous.wait_to_join(2);
  const auto runs = elastic_fit(kSlots, [&](int slot) {
    return slot == 2 ? std::make_shared<FakeGroup>(rendezvous, slot, FakeGroup::Joining{})
                     : std::make_shared<FakeGroup>(rendezvous, slot);
  });

  for (int slot = 0; slot < kSlots; ++slot) {
    const SlotRun& run = runs[static_cast<std::size_t>(slot)];
    ASSERT_EQ(run.error, "") << "slot " << slot;
    EXPECT_EQ(run.regroups, 0) << "slot " << slot; // nobody left
    EXPECT_EQ(run.workers, 3) << "slot " << slot;
    // The joiner counts on from the member's count it took: 12 updates everywhere.
    EXPECT_EQ(run.updates, 12) << "slot " << slot;
  }
  EXPECT_EQ(runs[0].admissions, 1);
  EXPECT_EQ(runs[1].admissions, 1);
  EXPECT_EQ(runs[2].admissions, 0); // admitted, not admitting
  EXPECT_TRUE(torch::equal(runs[0].weights, runs[1].weights));
  EXPECT_TRUE(
      torch::equal(runs[0].weights, runs[2].weights)); // the state it took, then the same steps
  // The global batch stayed 12 rows (6 per member, then 4 per member): the fault-free run's
  // updates, summed in another order.
  EXPECT_LT((runs[0].weights - reference).abs().max().item<double>(), 1e-5);
}

} // namespace
} // namespace flotilla
