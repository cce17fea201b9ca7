// TensorBoard event files: the log that tf.summary's file writer keeps and TensorBoard reads.
// A file is a sequence of TFRecord-framed tensorflow.Event protos (length, masked CRC-32C of the
// length, data, masked CRC-32C of the data); the first Event carries file_version
// "brain.Event:2", each later one a Summary with a scalar's tag and simple_value at a step.
//
// Event files are append-only logs, not atomic files (unlike checkpoints, see
// checkpoint/atomic_file.h): TensorBoard tails a file while training runs and shows each record
// as soon as it is flushed, which a file that appears only whole on close would defeat. Nothing
// is lost by that: readers stop at a truncated or torn last record and read on when it is
// complete, so a crash costs at most the records not yet flushed.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>

namespace flotilla::train {

class EventFileWriter {
 public:
  // Creates `dir` (and its parents) and in it a new file named as TensorFlow's writer
  // (tf.summary.create_file_writer) names it,
  //   events.out.tfevents.<unix seconds, 10 digits>.<hostname>.<pid>.<counter>.v2
  // (the counter, per process, keeps two writers started in the same second apart), then writes
  // and flushes the file_version event. ConfigError when the directory cannot be created or the
  // file cannot be created in it.
  explicit EventFileWriter(const std::filesystem::path& dir);
  // Flushes; an error then is logged, not thrown.
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One Event: `tag`'s value (stored as float32, as TensorFlow stores scalar summaries) at
  // `step`, stamped with the wall time. Events are queued and written out as
  // tf.summary.create_file_writer does by default: once more than 10 are queued, or 2 minutes
  // after the last flush; flush() writes them out now. Thread-safe.
  void scalar(const std::string& tag, double value, std::int64_t step);
  // Hands every queued event to the OS, where TensorBoard (or any reader) sees it; no fsync.
  // CheckpointError when a write fails (e.g. the disk is full): the file is cut back to its last
  // whole record and the events stay queued, so a later flush can still write them.
  void flush();

  const std::filesystem::path& path() const { return path_; }

 private:
  void queue(const std::string& event);
  void flush_locked();

  std::filesystem::path path_;
  int fd_ = -1;
  std::mutex mutex_;
  std::string queued_; // framed records not yet written
  int queued_events_ = 0;
  std::uint64_t written_ = 0; // bytes of whole records in the file
  std::chrono::steady_clock::time_point last_flush_;
};

} // namespace flotilla::train
