#include "train/event_codec.h"

#include "src/train/proto/event.pb.h"

namespace flotilla::train::detail {

std::string encode_event(const EventRecord& event) {
  proto::Event e;
  e.set_wall_time(event.wall_time);
  e.set_step(event.step);
  if (!event.file_version.empty()) {
    e.set_file_version(event.file_version);
  } else {
    proto::Summary* summary = e.mutable_summary();
    for (const auto& s : event.scalars) {
      proto::Summary::Value* v = summary->add_value();
      v->set_tag(s.tag);
      v->set_simple_value(s.value);
    }
  }
  return e.SerializeAsString();
}

} // namespace flotilla::train::detail
