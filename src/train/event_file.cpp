#include "flotilla/train/event_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "flotilla/base/tfrecord_framing.h"
#include "flotilla/error.h"
#include "flotilla/log.h"
#include "train/event_codec.h"

namespace flotilla::train {
namespace {

// tf.summary.create_file_writer's defaults: max_queue=10, flush_millis=120000.
constexpr int kMaxQueue = 10;
constexpr std::chrono::milliseconds kFlushEvery{120000};

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

double now_seconds() {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::system_clock::now().time_since_epoch());
  return static_cast<double>(us.count()) / 1e6; // microseconds, as TensorFlow stamps events
}

} // namespace

EventFileWriter::EventFileWriter(const std::filesystem::path& dir) {
  if (dir.empty()) {
    throw ConfigError("EventFileWriter: the log directory is empty; give a directory for the "
                      "event files (TensorBoard's --logdir)");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    throw ConfigError(dir.string() + ": cannot create the log directory (" + ec.message() +
                      "); choose a writable directory for the event files");
  }
  static std::atomic<std::int64_t> counter{0};
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  const std::string host = hostname();
  for (;;) {
    char stamp[32];
    std::snprintf(stamp, sizeof stamp, "%010lld", static_cast<long long>(seconds));
    path_ = dir / ("events.out.tfevents." + std::string(stamp) + "." + host + "." +
                   std::to_string(::getpid()) + "." + std::to_string(counter++) + ".v2");
    // O_EXCL: never append to, or clobber, another writer's file.
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ >= 0) break;
    if (errno != EEXIST) {
      throw ConfigError("cannot create the event file " + path_.string() + " (" +
                        std::strerror(errno) + "); choose a writable log directory");
    }
  }
  last_flush_ = std::chrono::steady_clock::now();
  detail::EventRecord version;
  version.wall_time = static_cast<double>(seconds);
  version.file_version = "brain.Event:2";
  std::lock_guard<std::mutex> lock(mutex_);
  queue(detail::encode_event(version));
  try {
    flush_locked(); // the file says what it is from its first moment
  } catch (...) {
    ::close(fd_);
    ::unlink(path_.c_str());
    throw;
  }
}

EventFileWriter::~EventFileWriter() {
  try {
    flush();
  } catch (const std::exception& e) {
    Logger().warn(std::string(e.what()) + "; " + std::to_string(queued_events_) +
                  " events were not written");
  }
  ::close(fd_);
}

void EventFileWriter::scalar(const std::string& tag, double value, std::int64_t step) {
  detail::EventRecord event;
  event.wall_time = now_seconds();
  event.step = step;
  event.scalars.push_back({tag, static_cast<float>(value)});
  const std::string serialized = detail::encode_event(event);
  std::lock_guard<std::mutex> lock(mutex_);
  queue(serialized);
  if (queued_events_ > kMaxQueue || std::chrono::steady_clock::now() - last_flush_ > kFlushEvery) {
    flush_locked();
  }
}

void EventFileWriter::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  flush_locked();
}

void EventFileWriter::queue(const std::string& event) {
  base::append_tfrecord(queued_, event);
  ++queued_events_;
}

void EventFileWriter::flush_locked() {
  last_flush_ = std::chrono::steady_clock::now();
  std::size_t done = 0;
  while (done < queued_.size()) {
    const ssize_t n = ::write(fd_, queued_.data() + done, queued_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = std::strerror(errno);
      // A torn record would end the file for every reader: cut it back to whole records (the
      // next write appends at the new end) and keep the events for a later flush.
      if (done > 0) (void)::ftruncate(fd_, static_cast<off_t>(written_));
      throw CheckpointError("cannot write the event file " + path_.string() + " (" + why +
                            "); free disk space or choose another log directory; " +
                            std::to_string(queued_events_) + " events are still queued");
    }
    done += static_cast<std::size_t>(n);
  }
  written_ += queued_.size();
  queued_.clear();
  queued_events_ = 0;
}

} // namespace flotilla::train
