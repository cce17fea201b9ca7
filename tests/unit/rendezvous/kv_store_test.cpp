// The rendezvous store's semantics without a network: c10d's add, compareSet and deleteKey, the
// waits and the order they are answered in, their deadlines, and the bounds.
#include "rendezvous/kv_store.h"

#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace flotilla::collective::detail {
namespace {

using Bytes = KvStore::Bytes;
using Clock = KvStore::Clock;

Bytes bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

std::string text(const Bytes* b) {
  return b ? std::string(b->begin(), b->end()) : "<absent>";
}

// A store that records whom it woke and with what.
struct Recorder {
  // owner, GET's values ("," between a multiGet's) or "<wait>"
  std::vector<std::pair<int, std::string>> woken;
  KvStore store;
  explicit Recorder(KvStore::Limits limits = {})
      : store(
            [this](const KvStore::Waiter& w, const std::vector<const Bytes*>& values) {
              std::string all;
              for (const Bytes* v : values) all += (all.empty() ? "" : ",") + text(v);
              woken.emplace_back(w.owner, w.wants_values() ? all : "<wait>");
            },
            limits) {}
};

KvStore::Waiter waiter(int owner, std::vector<std::string> keys, bool get,
                       Clock::time_point deadline = Clock::time_point::max()) {
  KvStore::Waiter w;
  w.owner = owner;
  w.keys = std::move(keys);
  w.answer = get ? KvStore::Waiter::Answer::kValue : KvStore::Waiter::Answer::kPresence;
  w.deadline = deadline;
  return w;
}

TEST(KvStore, AddReturnsTheRunningSumAndStoresItAsDecimalText) {
  Recorder r;
  EXPECT_EQ(r.store.add("n", 5), 5); // an absent key counts from 0
  EXPECT_EQ(r.store.add("n", -2), 3);
  EXPECT_EQ(r.store.add("n", 40), 43);
  EXPECT_EQ(text(r.store.get("n")), "43");
  r.store.set("m", bytes("-7"));
  EXPECT_EQ(r.store.add("m", 10), 3);
  // Past the int64 range it wraps around instead of reaching undefined behaviour.
  r.store.set("big", bytes(std::to_string(std::numeric_limits<std::int64_t>::max())));
  EXPECT_EQ(r.store.add("big", 1), std::numeric_limits<std::int64_t>::min());
}

TEST(KvStore, AddOnAValueThatIsNotANumberIsRefusedAndChangesNothing) {
  Recorder r;
  r.store.set("k", bytes("abc"));
  try {
    r.store.add("k", 1);
    FAIL() << "no error";
  } catch (const KvStoreError& e) {
    EXPECT_EQ(std::string(e.what()), "add: the value of \"k\" is not a number");
  }
  EXPECT_EQ(text(r.store.get("k")), "abc");
}

TEST(KvStore, CompareSetFollowsC10dsSemantics) {
  Recorder r;
  r.store.set("k", bytes("old"));
  // A wrong expected value: nothing is stored and the current value comes back.
  EXPECT_EQ(r.store.compare_set("k", bytes("wrong"), bytes("new")), bytes("old"));
  EXPECT_EQ(text(r.store.get("k")), "old");
  // The right one: the desired value is stored and comes back.
  EXPECT_EQ(r.store.compare_set("k", bytes("old"), bytes("new")), bytes("new"));
  EXPECT_EQ(text(r.store.get("k")), "new");
  // An absent key is set only when the expected value is empty...
  EXPECT_EQ(r.store.compare_set("fresh", {}, bytes("x")), bytes("x"));
  EXPECT_EQ(text(r.store.get("fresh")), "x");
  // ...otherwise the expected value comes back and the key stays absent.
  EXPECT_EQ(r.store.compare_set("absent", bytes("e"), bytes("x")), bytes("e"));
  EXPECT_EQ(r.store.get("absent"), nullptr);
  EXPECT_EQ(r.store.num_keys(), 2u);
}

TEST(KvStore, SetEraseAndTheCountsTheBoundsUse) {
  Recorder r;
  r.store.set("ab", bytes("xyz"));
  EXPECT_EQ(r.store.bytes(), 5u); // key and value
  r.store.set("ab", bytes("q"));  // a replaced value no longer counts
  EXPECT_EQ(r.store.bytes(), 3u);
  r.store.set("c", {});
  EXPECT_EQ(r.store.num_keys(), 2u);
  EXPECT_TRUE(r.store.contains({"ab", "c"}));
  EXPECT_FALSE(r.store.contains({"ab", "absent"}));
  EXPECT_TRUE(r.store.erase("ab"));
  EXPECT_FALSE(r.store.erase("ab"));
  EXPECT_EQ(r.store.get("ab"), nullptr);
  EXPECT_EQ(r.store.bytes(), 1u);
  EXPECT_EQ(r.store.num_keys(), 1u);
}

TEST(KvStore, AWaitIsWokenByTheSetOfItsLastKey) {
  Recorder r;
  r.store.wait(waiter(7, {"a", "b"}, /*get=*/false));
  EXPECT_TRUE(r.woken.empty());
  r.store.set("a", bytes("1"));
  EXPECT_TRUE(r.woken.empty()) << "woken with b still missing";
  EXPECT_EQ(r.store.num_waiters(), 1u);
  r.store.set("b", bytes("2"));
  ASSERT_EQ(r.woken.size(), 1u);
  EXPECT_EQ(r.woken[0], std::make_pair(7, std::string("<wait>")));
  EXPECT_EQ(r.store.num_waiters(), 0u);
  r.store.set("b", bytes("3")); // answered once only
  EXPECT_EQ(r.woken.size(), 1u);
}

TEST(KvStore, AGetIsAnsweredWithTheValueNowOrOnceItIsSet) {
  Recorder r;
  r.store.set("here", bytes("v1"));
  r.store.wait(waiter(1, {"here"}, /*get=*/true)); // present: answered inside wait()
  ASSERT_EQ(r.woken.size(), 1u);
  EXPECT_EQ(r.woken[0], std::make_pair(1, std::string("v1")));
  r.store.wait(waiter(2, {"later"}, /*get=*/true));
  r.store.wait(waiter(3, {"later"}, /*get=*/true));
  r.store.add("later", 9); // any operation that stores a value wakes
  ASSERT_EQ(r.woken.size(), 3u);
  // In the order they came.
  EXPECT_EQ(r.woken[1], std::make_pair(2, std::string("9")));
  EXPECT_EQ(r.woken[2], std::make_pair(3, std::string("9")));
}

// Gloo's forming groups read their peers' addresses 128 keys per multiGet (GLOO_ENABLE_STORE_V2_API).
TEST(KvStore, AGetOfSeveralKeysIsAnsweredOnceAllExistWithTheirValuesInItsOrder) {
  Recorder r;
  r.store.set("k1", bytes("one"));
  r.store.wait(waiter(4, {"k2", "k1", "k3"}, /*get=*/true));
  r.store.wait(waiter(5, {"k3"}, /*get=*/true));
  r.store.set("k3", bytes("three")); // wakes 5 only: 4 still misses k2
  ASSERT_EQ(r.woken.size(), 1u);
  EXPECT_EQ(r.woken[0], std::make_pair(5, std::string("three")));
  r.store.set("k2", bytes("two"));
  ASSERT_EQ(r.woken.size(), 2u);
  EXPECT_EQ(r.woken[1], std::make_pair(4, std::string("two,one,three")));
  EXPECT_EQ(r.store.num_waiters(), 0u);
}

// A waiter is woken by the set of the key it is blocked on; one of its keys erased after it was
// seen (a generation's keys going at g-2) is looked for again, not taken as present.
TEST(KvStore, AKeyErasedAfterAWaiterPassedItIsWaitedForAgain) {
  Recorder r;
  r.store.set("a", bytes("1"));
  r.store.wait(waiter(8, {"a", "b"}, /*get=*/false));
  EXPECT_TRUE(r.store.erase("a"));
  r.store.set("b", bytes("2"));
  EXPECT_TRUE(r.woken.empty()) << "woken with a erased";
  EXPECT_EQ(r.store.num_waiters(), 1u);
  r.store.set("a", bytes("3"));
  ASSERT_EQ(r.woken.size(), 1u);
  EXPECT_EQ(r.woken[0].first, 8);
  EXPECT_EQ(r.store.num_waiters(), 0u);
  // Answered once: its deadline went with it.
  EXPECT_TRUE(r.store.expire(Clock::time_point::max()).empty());
}

TEST(KvStore, WaitersExpireAtTheirDeadlineInTheOrderTheyCame) {
  Recorder r;
  const auto t0 = Clock::time_point() + std::chrono::hours(1);
  r.store.wait(waiter(1, {"x"}, false, t0 + std::chrono::seconds(2)));
  r.store.wait(waiter(2, {"x"}, true, t0 + std::chrono::seconds(1)));
  r.store.wait(waiter(3, {"x"}, false, t0 + std::chrono::seconds(1)));
  EXPECT_TRUE(r.store.expire(t0).empty());
  const auto at_one = r.store.expire(t0 + std::chrono::seconds(1)); // at the deadline: expired
  ASSERT_EQ(at_one.size(), 2u);
  EXPECT_EQ(at_one[0].owner, 2);
  EXPECT_TRUE(at_one[0].wants_values());
  EXPECT_EQ(at_one[1].owner, 3);
  EXPECT_TRUE(r.store.expire(t0 + std::chrono::milliseconds(1999)).empty());
  r.store.set("x", bytes("v")); // the one left is answered; the expired are not
  ASSERT_EQ(r.woken.size(), 1u);
  EXPECT_EQ(r.woken[0].first, 1);
  EXPECT_TRUE(r.store.expire(t0 + std::chrono::seconds(3)).empty());
}

TEST(KvStore, AForgottenOwnersWaitersAreNeverAnswered) {
  Recorder r;
  r.store.wait(waiter(5, {"k"}, true));
  r.store.wait(waiter(6, {"k"}, false));
  r.store.wait(waiter(5, {"j"}, false));
  r.store.forget(5);
  EXPECT_EQ(r.store.num_waiters(), 1u);
  r.store.set("k", bytes("v"));
  r.store.set("j", bytes("v"));
  ASSERT_EQ(r.woken.size(), 1u);
  EXPECT_EQ(r.woken[0].first, 6);
}

void expect_full(const std::function<void()>& operation) {
  try {
    operation();
    FAIL() << "not refused";
  } catch (const KvStoreError& e) {
    EXPECT_EQ(std::string(e.what()), "the rendezvous store is full");
  }
}

TEST(KvStore, TheBoundsRefuseWithTheStoreIsFullAndChangeNothing) {
  Recorder r(KvStore::Limits{/*bytes=*/10, /*keys=*/2});
  r.store.set("a", bytes("1234")); // 5 bytes
  r.store.set("b", bytes("1234")); // 10: exactly at the limit
  r.store.wait(waiter(1, {"c"}, false));
  expect_full([&] { r.store.set("c", {}); }); // a third key
  expect_full([&] { r.store.add("c", 1); });
  expect_full([&] { r.store.compare_set("c", {}, bytes("x")); });
  expect_full([&] { r.store.set("a", bytes("12345")); }); // 11 bytes
  expect_full([&] { r.store.add("a", 99999); });          // "101233": 12 bytes
  EXPECT_EQ(text(r.store.get("a")), "1234");
  EXPECT_EQ(r.store.get("c"), nullptr);
  EXPECT_EQ(r.store.bytes(), 10u);
  EXPECT_TRUE(r.woken.empty()) << "a refused set woke a waiter";
  // Within the limits again, the same operations go through.
  r.store.set("a", bytes("12")); // 8 bytes
  EXPECT_EQ(r.store.bytes(), 8u);
  EXPECT_TRUE(r.store.erase("b"));
  r.store.set("c", bytes("1"));
  ASSERT_EQ(r.woken.size(), 1u);
  EXPECT_EQ(r.woken[0].first, 1);
}

TEST(KvStore, AGenerationsWaitersAreCancelledAndItsKeysErasedByPrefix) {
  Recorder r;
  r.store.wait(waiter(1, {"flotilla/g1/gloo/0"}, true));
  r.store.wait(waiter(2, {"other", "flotilla/g1/x"}, false));
  r.store.wait(waiter(3, {"flotilla/g10/gloo/0"}, true)); // g10 is not g1's
  r.store.wait(waiter(4, {"flotilla/g2/gloo/0"}, true));
  const auto cancelled = r.store.cancel({"flotilla/g1/", "flotilla/g0/"});
  ASSERT_EQ(cancelled.size(), 2u);
  EXPECT_EQ(cancelled[0].owner, 1);
  EXPECT_EQ(cancelled[1].owner, 2);
  EXPECT_EQ(r.store.num_waiters(), 2u);
  EXPECT_TRUE(r.woken.empty()) << "a cancelled waiter is the server's to answer";
  r.store.set("flotilla/g1/a", bytes("1"));
  r.store.set("flotilla/g1/b", bytes("22"));
  r.store.set("flotilla/g10/a", bytes("3"));
  EXPECT_EQ(r.store.erase_prefix("flotilla/g1/"), 2u);
  EXPECT_EQ(r.store.num_keys(), 1u);
  EXPECT_EQ(r.store.bytes(), std::string("flotilla/g10/a").size() + 1);
}

TEST(KvStore, TheDefaultBoundsAre256MiBAndAMillionKeys) {
  const KvStore::Limits limits;
  EXPECT_EQ(limits.bytes, std::size_t{256} << 20);
  EXPECT_EQ(limits.keys, std::size_t{1} << 20);
}

} // namespace
} // namespace flotilla::collective::detail
