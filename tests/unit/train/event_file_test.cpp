#include "flotilla/train/event_file.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <tuple>
#include <vector>

#include "flotilla/data/tfrecord.h"
#include "flotilla/error.h"
#include "support/paths.h"
#include "support/subprocess.h"
#include "support/tensorboard.h"

namespace flotilla::train {
namespace {

using flotilla::testing::TempDir;
namespace fs = std::filesystem;

// --- a protobuf wire-format reader, independent of our schema: it checks the field numbers ---

struct Field {
  int number = 0;
  int wire = 0;           // 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32
  std::uint64_t bits = 0; // varint and fixed values
  std::string bytes;      // length-delimited values
};

std::uint64_t varint(const std::string& m, std::size_t& at) {
  std::uint64_t v = 0;
  for (int shift = 0; at < m.size() && shift < 64; shift += 7) {
    const auto b = static_cast<unsigned char>(m[at++]);
    v |= std::uint64_t{b & 0x7fu} << shift;
    if (!(b & 0x80u)) return v;
  }
  throw std::runtime_error("malformed varint");
}

std::vector<Field> fields_of(const std::string& m) {
  std::vector<Field> out;
  std::size_t at = 0;
  while (at < m.size()) {
    Field f;
    const std::uint64_t key = varint(m, at);
    f.number = static_cast<int>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) {
      f.bits = varint(m, at);
    } else if (f.wire == 1 || f.wire == 5) {
      const std::size_t n = f.wire == 1 ? 8 : 4;
      if (at + n > m.size()) throw std::runtime_error("truncated fixed field");
      std::memcpy(&f.bits, m.data() + at, n);
      at += n;
    } else if (f.wire == 2) {
      const std::uint64_t n = varint(m, at);
      if (n > m.size() - at) throw std::runtime_error("truncated length-delimited field");
      f.bytes = m.substr(at, n);
      at += n;
    } else {
      throw std::runtime_error("unexpected wire type " + std::to_string(f.wire));
    }
    out.push_back(std::move(f));
  }
  return out;
}

double as_double(const Field& f) {
  double d;
  std::memcpy(&d, &f.bits, 8);
  return d;
}

float as_float(const Field& f) {
  const auto u = static_cast<std::uint32_t>(f.bits);
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// tensorflow.Event, read with TensorFlow's field numbers: wall_time 1 (double), step 2 (int64),
// file_version 3 (string), summary 5 (Summary: value 1, Value: tag 1, simple_value 2 (float)).
struct Event {
  double wall_time = 0;
  std::int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> scalars;
  std::vector<int> fields; // every field number, in order
};

Event decode(const std::string& record) {
  Event e;
  for (const Field& f : fields_of(record)) {
    e.fields.push_back(f.number);
    if (f.number == 1 && f.wire == 1) e.wall_time = as_double(f);
    if (f.number == 2 && f.wire == 0) e.step = static_cast<std::int64_t>(f.bits);
    if (f.number == 3 && f.wire == 2) e.file_version = f.bytes;
    if (f.number == 5 && f.wire == 2) {
      for (const Field& value : fields_of(f.bytes)) {
        if (value.number != 1 || value.wire != 2) continue;
        std::string tag;
        float v = NAN;
        for (const Field& g : fields_of(value.bytes)) {
          if (g.number == 1 && g.wire == 2) tag = g.bytes;
          if (g.number == 2 && g.wire == 5) v = as_float(g);
        }
        e.scalars.emplace_back(tag, v);
      }
    }
  }
  return e;
}

// Every record of the file, framing and CRCs verified.
std::vector<std::string> records_of(const fs::path& path) {
  data::TFRecordReader reader(path.string());
  std::vector<std::string> out;
  while (auto r = reader.next()) out.push_back(std::move(*r));
  return out;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

TEST(EventFileWriter, FirstRecordIsTheFileVersionAndScalarsFollowAsSummaries) {
  TempDir dir;
  const double before = now_seconds();
  fs::path path;
  {
    EventFileWriter writer(fs::path(dir.path()) / "logs" / "train"); // parents created
    path = writer.path();
    writer.scalar("loss", 0.25, 0);
    writer.scalar("loss", 0.0, 1); // a zero is still a value, not an absent one
    writer.scalar("lr", 0.1, 1 << 20);
  } // the destructor flushes
  const double after = now_seconds();
  const auto records = records_of(path);
  ASSERT_EQ(records.size(), 4u);

  const Event version = decode(records[0]);
  EXPECT_EQ(version.file_version, "brain.Event:2");
  EXPECT_EQ(version.fields, (std::vector<int>{1, 3})); // wall_time, file_version: nothing else
  EXPECT_GE(version.wall_time, std::floor(before));
  EXPECT_LE(version.wall_time, after);
  // Byte for byte as TensorFlow writes it: field 1 as fixed64, field 3 as 13 bytes of text.
  std::string expected = "\x09" + records[0].substr(1, 8) +
                         "\x1a\x0d"
                         "brain.Event:2";
  EXPECT_EQ(records[0], expected);

  const std::vector<std::tuple<std::int64_t, std::string, float>> want = {
      {0, "loss", 0.25f}, {1, "loss", 0.0f}, {1 << 20, "lr", 0.1f}};
  double last_time = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const Event e = decode(records[i + 1]);
    EXPECT_TRUE(e.file_version.empty());
    EXPECT_EQ(e.step, std::get<0>(want[i])) << i;
    ASSERT_EQ(e.scalars.size(), 1u) << i;
    EXPECT_EQ(e.scalars[0].first, std::get<1>(want[i])) << i;
    EXPECT_EQ(e.scalars[0].second, std::get<2>(want[i])) << i;
    EXPECT_GE(e.wall_time, before) << i;
    EXPECT_LE(e.wall_time, after) << i;
    EXPECT_GE(e.wall_time, last_time) << i;
    last_time = e.wall_time;
  }
}

TEST(EventFileWriter, NamesTheFileAsTensorFlowDoesAndNeverReusesAName) {
  TempDir dir;
  EventFileWriter a(dir.path());
  EventFileWriter b(dir.path()); // same process, likely the same second
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::regex name("events\\.out\\.tfevents\\.(\\d{10})\\." + std::string(host) + "\\." +
                        std::to_string(::getpid()) + "\\.\\d+\\.v2");
  std::smatch m;
  const std::string name_a = a.path().filename().string();
  ASSERT_TRUE(std::regex_match(name_a, m, name)) << name_a;
  EXPECT_NEAR(std::stod(m[1]), now_seconds(), 60);
  const std::string name_b = b.path().filename().string();
  EXPECT_TRUE(std::regex_match(name_b, name)) << name_b;
  EXPECT_NE(a.path(), b.path());
  EXPECT_EQ(a.path().parent_path(), fs::path(dir.path()));
  EXPECT_EQ(records_of(b.path()).size(), 1u); // each starts with its own file_version event
}

TEST(EventFileWriter, QueuesLikeTensorFlowAndFlushHandsEventsToTheOS) {
  TempDir dir;
  EventFileWriter writer(dir.path());
  EXPECT_EQ(records_of(writer.path()).size(), 1u); // the file_version event is flushed at once
  for (int i = 0; i < 10; ++i) writer.scalar("x", i, i);
  EXPECT_EQ(records_of(writer.path()).size(), 1u); // 10 queued: max_queue is not exceeded
  writer.scalar("x", 10, 10);
  EXPECT_EQ(records_of(writer.path()).size(), 12u); // the 11th event flushes the queue
  writer.scalar("y", 1, 11);
  writer.flush();
  EXPECT_EQ(records_of(writer.path()).size(), 13u);
  writer.flush(); // nothing queued: nothing written
  EXPECT_EQ(records_of(writer.path()).size(), 13u);
}

TEST(EventFileWriter, AFailedWriteLeavesWholeRecordsAndKeepsTheEvents) {
  TempDir dir;
  EventFileWriter writer(dir.path());
  const auto size = fs::file_size(writer.path());
  // A file-size limit makes write() fail part way (EFBIG) as a full disk would.
  rlimit old{};
  ::getrlimit(RLIMIT_FSIZE, &old);
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = old;
  limited.rlim_cur = size + 100;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  for (int i = 0; i < 10; ++i) writer.scalar("loss", 1.0 / (i + 1), i);
  std::string message;
  try {
    writer.flush();
  } catch (const CheckpointError& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_NE(message.find("cannot write the event file " + writer.path().string()),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("10 events are still queued"), std::string::npos) << message;
  EXPECT_EQ(fs::file_size(writer.path()), size); // cut back: no torn record
  EXPECT_EQ(records_of(writer.path()).size(), 1u);
  writer.flush(); // room again: the queued events are written
  const auto records = records_of(writer.path());
  ASSERT_EQ(records.size(), 11u);
  EXPECT_EQ(decode(records[10]).step, 9);
}

TEST(EventFileWriter, AnUnusableDirectoryIsAConfigErrorNamingIt) {
  TempDir dir;
  const fs::path file = fs::path(dir.path()) / "not-a-dir";
  std::ofstream(file) << "x";
  const fs::path logdir = file / "logs";
  try {
    EventFileWriter writer(logdir);
    FAIL() << "no error for " << logdir;
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(logdir.string() + ": cannot create the log directory ("),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("choose a writable directory"), std::string::npos) << message;
  }
  EXPECT_THROW(EventFileWriter(""), ConfigError);
}

// --- TensorBoard itself reads the files ---

using flotilla::testing::tensorboard_installed;
using flotilla::testing::tensorboard_view;

TEST(EventFileWriter, TensorBoardReadsTheScalarsWhileAndAfterTheyAreWritten) {
  if (!tensorboard_installed()) {
    GTEST_SKIP() << "the test venv's Python (" << flotilla::testing::test_python()
                 << ") cannot import tensorboard; run scripts/bootstrap to install it";
  }
  TempDir dir;
  const std::string logdir = dir.path() + "/train";
  struct Scalar {
    std::string tag;
    double value;
    std::int64_t step;
  };
  // Per-batch values first, then per-epoch ones at smaller steps: with a file_version of 2,
  // TensorBoard keeps events whose step goes back (older files would have been purged).
  const std::vector<Scalar> first = {
      {"batch/loss", 2.5, 0},
      {"batch/loss", 1.75, 1},
      {"batch/loss", -3.25, 2},
      {"batch/lr", 0.1, 0},
      {"batch/lr", 0.0, 1},
      {"batch/loss", 1e30, 3},
      {"batch/loss", 123456789.0, std::int64_t{1} << 40},
  };
  const std::vector<Scalar> second = {
      {"epoch/loss", 0.6931471805599453, 0}, {"epoch/loss", -1e-7, 1}, {"epoch/accuracy", 1, 1}};

  auto check = [](const nlohmann::json& view, const std::vector<Scalar>& written) {
    std::map<std::string, std::vector<const Scalar*>> by_tag;
    for (const auto& s : written) by_tag[s.tag].push_back(&s);
    ASSERT_EQ(view["scalars"].size(), by_tag.size()) << view.dump();
    for (const auto& [tag, scalars] : by_tag) {
      const auto& got = view["scalars"][tag];
      ASSERT_EQ(got.size(), scalars.size()) << tag << ": " << view.dump();
      for (std::size_t i = 0; i < scalars.size(); ++i) {
        EXPECT_EQ(got[i]["step"].get<std::int64_t>(), scalars[i]->step) << tag << " " << i;
        // TensorBoard's value is the float32 we stored, widened: it compares exactly.
        EXPECT_EQ(got[i]["value"].get<double>(),
                  static_cast<double>(static_cast<float>(scalars[i]->value)))
            << tag << " " << i;
        EXPECT_NEAR(got[i]["wall_time"].get<double>(), now_seconds(), 600) << tag << " " << i;
      }
    }
    EXPECT_EQ(view["file_version"], 2.0) << view.dump();
  };

  std::vector<Scalar> all = first;
  {
    EventFileWriter writer(logdir);
    for (const auto& s : first) writer.scalar(s.tag, s.value, s.step);
    writer.flush();
    check(tensorboard_view(logdir), first); // read while the writer is still open
    for (const auto& s : second) {
      writer.scalar(s.tag, s.value, s.step);
      all.push_back(s);
    }
  }
  check(tensorboard_view(logdir), all);
}

} // namespace
} // namespace flotilla::train
