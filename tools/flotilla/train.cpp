// `flotilla train`: one worker of a data-parallel training job. The cluster comes from
// TF_CONFIG (or torchrun variables, or nothing: one worker alone); start one per task, or let
// `flotilla launch` start them on this machine.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "flotilla/base/system.h"
#include "flotilla/cluster/cluster_token.h"
#include "flotilla/cluster/resolvers.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/data/distribute.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/data/image.h"
#include "flotilla/data/image_folder.h"
#include "flotilla/error.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/compile.h"
#include "flotilla/profile/batch_search.h"
#include "flotilla/profile/compute.h"
#include "flotilla/profile/profiler.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/model.h"
#include "flotilla/train/recipe.h"
#include "flotilla/train/schedules.h"
#include "flotilla/train/sidecar_evaluator.h"
#include "flotilla/train/sync_batchnorm.h"
#include "flotilla/train/torchscript.h"
#include "models/zoo.h"
#include "tools/flotilla/commands.h"
#include "tools/flotilla/flags.h"

namespace flotilla::tools {
namespace {
namespace fs = std::filesystem;

struct TrainArgs {
  std::string model = "cnn";
  std::string dataset = "fashion-mnist";
  std::string data_dir = data::kFashionMnistDir;
  // --dataset image-folder: DIR/train and DIR/test class folders, or DIR's own split.
  double validation_split = 0;
  std::vector<std::int64_t> image_size = {28, 28};
  std::string color_mode = "grayscale";
  std::int64_t steps_per_epoch = 0; // 0: the whole dataset
  std::int64_t batch_per_replica = 32;
  // The recipe (the flags bind to it): precision, optimizer, learning rate and its scaling,
  // schedule, epochs, accumulation.
  train::RecipeOptions recipe;
  double label_smoothing = 0;
  std::string channels_last = "auto";
  std::string freed_memory = "keep"; // keep: base::keep_freed_memory(); release: malloc's default
  std::string jit_compile = "auto"; // auto, on, off: CompileOptions::jit_compile unset, true, false
  std::string kernels = "measure";  // kernels::Mode
  std::string kernel_cache;         // "": kernels::cache_directory()'s default
  bool sync_batchnorm = false;
  int steps_per_execution = 1;
  std::uint64_t seed = 42;
  std::string checkpoint_dir;
  int max_to_keep = 3;
  std::string backup_dir;
  std::int64_t backup_freq = 0;
  double preemption_check_ms = 500; // 0: the workers compare SIGTERM requests every step
  std::string tensorboard_dir;
  std::string csv_log;
  bool validation = false;
  int threads = 0; // 0: cores ÷ workers on this machine
  std::string metrics_json;
  std::string step_ledger;  // a directory: ledger-<pid>.txt per process
  std::string profile_json; // the run's record (flotilla.run/1), for plan and doctor
  std::string trace;        // the timeline: Chrome trace-event JSON
  std::string report;       // the HTML report
  bool no_doctor = false;
  std::string command; // this process's argv, for the report
  double timeout_s = 300;
  std::string cluster_token_file; // "": FLOTILLA_CLUSTER_TOKEN(_FILE) or none
  bool insecure = false;          // CommunicationOptions::insecure
  std::string implementation = "auto";
  std::int64_t bytes_per_pack = 25 * 1024 * 1024;
  bool no_overlap = false;
  bool no_shared_memory = false;
  bool elastic = false;                 // ElasticOptions::enabled
  std::string elastic_batch = "global"; // ElasticOptions::batch
  std::string shares = "auto";          // auto, equal, or W1,W2,... (Strategy::set_shares)
  bool shares_given = false;            // --shares named; left out, auto where it applies
  double straggler_floor = 0.1;         // FitOptions::straggler_floor, with --shares auto
  double heartbeat_timeout_s = 10;      // CommunicationOptions::heartbeat_timeout
  std::string compression = "none";
  int replicas_per_worker = 0; // 0: one per device in --devices
  std::string devices = "auto";
  std::string verbose = "auto";
  std::int64_t shuffle_buffer = 10000;
  std::string cache = "none";
  bool augment = false;
};

void append_json_line(const std::string& path, const nlohmann::ordered_json& object) {
  std::ofstream out(path, std::ios::app);
  out << object.dump() << "\n";
  if (!out.flush()) {
    throw ConfigError("cannot append to --metrics-json file " + path + "; check the path");
  }
}

// This process's command line, quoted where a word needs it, for the report's header.
std::string this_command() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  constexpr const char* kPlain =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@";
  std::string word, line;
  while (std::getline(in, word, '\0')) {
    const bool plain = !word.empty() && word.find_first_not_of(kPlain) == std::string::npos;
    if (!line.empty()) line += ' ';
    if (plain) {
      line += word;
    } else {
      line += '\'';
      for (char c : word) line += c == '\'' ? std::string("'\\''") : std::string(1, c);
      line += '\'';
    }
  }
  return line;
}

// The library's recipe (precision, linear scaling, warmup + cosine) from the flags, plus what
// only this command decides: the compiled step, the input pipeline and the batch.
train::Recipe make_recipe(const TrainArgs& a, std::int64_t global_batch,
                          std::int64_t steps_per_epoch, const torch::Device& device) {
  train::Recipe r = train::make_recipe(a.recipe, global_batch, steps_per_epoch, device);
  const std::string kernels =
      a.kernels == "measure" ? "flotilla's kernels where they measure faster than ATen's on this "
                               "CPU (--kernels fixed: wherever they apply; none: ATen's)"
      : a.kernels == "fixed" ? "flotilla's kernels wherever they apply (--kernels fixed)"
                             : "ATen's operations only (--kernels none)";
  std::string compiled;
  if (device.is_cuda()) {
    compiled = a.jit_compile == "on" ? "jit_compile: the step in a CUDA graph where it applies "
                                       "(the jit_compile line says)"
                                     : "off (--jit-compile captures the step in a CUDA graph)";
  } else {
    compiled = a.jit_compile == "off" || a.kernels == "none"
                   ? "off: the model runs as written (--no-jit-compile or --kernels none)"
                   : "the compile step rewrites the model's layers for " + kernels +
                         " (the next line says what it rewrote; --no-jit-compile turns it off)";
  }
  r.lines.push_back("compiled step: " + compiled);
  r.lines.push_back("input pipeline: shuffle, batch, parallel map (AUTOTUNE), prefetch (AUTOTUNE)" +
                    std::string(a.cache != "none" ? ", cache" : "") +
                    std::string(device.is_cuda() ? ", prefetch_to_device (pinned)" : "") +
                    "; each worker prepares only its own slice");
  r.lines.push_back("batch: " + std::to_string(a.batch_per_replica) + " per replica, global " +
                    std::to_string(global_batch) +
                    " (the largest batch that fits is not searched for: set --batch-per-replica)");
  return r;
}

// "cpu", "cuda:0,cuda:1", "2 x cpu".
std::string device_list(const std::vector<torch::Device>& devices) {
  if (devices.size() > 1 && devices.front().is_cpu()) {
    return std::to_string(devices.size()) + " x cpu";
  }
  std::string out;
  for (const auto& d : devices) out += (out.empty() ? "" : ",") + d.str();
  return out;
}

// Only Fashion-MNIST so far.
void check_dataset(const TrainArgs& a) {
  if (a.dataset != "fashion-mnist" && a.dataset != "image-folder") {
    throw ConfigError("--dataset \"" + a.dataset +
                      "\" is not available; use fashion-mnist or image-folder");
  }
  if (a.dataset == "image-folder" && a.validation_split > 0 && a.validation) {
    throw ConfigError("--validation with --validation-split on one image folder: the split-off "
                      "images are what the run reports as its test, so validating on them each "
                      "epoch would report the same images twice; give --data-dir train/ and "
                      "test/ folders (--validation then holds out 10% of train/), or drop "
                      "--validation");
  }
  if (a.dataset == "fashion-mnist" && a.validation_split != 0 && !a.validation) {
    throw ConfigError("--validation-split on Fashion-MNIST is the fraction of its training "
                      "images held out for --validation (it has its own test split); add "
                      "--validation, or drop --validation-split");
  }
  if (a.dataset == "fashion-mnist" &&
      (a.image_size != std::vector<std::int64_t>{28, 28} || a.color_mode != "grayscale")) {
    throw ConfigError("--image-size and --color-mode apply to --dataset image-folder; "
                      "Fashion-MNIST's images are 1x28x28");
  }
}

// --threads 0: this machine's cores shared among the workers on it. With how the count was
// found, for the strategy's line.
struct Threads {
  int count = 1;
  std::string how;
};
Threads threads_per_worker(const TrainArgs& a, const cluster::Environment& env) {
  if (a.threads > 0) return {a.threads, "--threads"};
  const cluster::LocalWorkers local = cluster::local_workers(env);
  const int cores = base::available_cores();
  return {std::max(1, cores / local.count),
          std::to_string(cores) + " core(s) / " + std::to_string(local.count) +
              " worker(s) on this host, from " + local.source + "; --threads sets it"};
}

collective::CommunicationOptions communication_options(const TrainArgs& a,
                                                       const cluster::Environment& env) {
  collective::CommunicationOptions comm;
  comm.implementation = collective::parse_implementation(a.implementation);
  comm.timeout = seconds_flag(a.timeout_s, "--timeout");
  comm.cluster_token = cluster::cluster_token(
      env,
      a.cluster_token_file.empty() ? std::nullopt : std::optional<fs::path>(a.cluster_token_file));
  // A token `flotilla launch` made for this run alone cannot key what a later run resumes from.
  if (!env.get("FLOTILLA_CLUSTER_TOKEN_RUN_ONLY")) comm.checkpoint_key = comm.cluster_token;
  comm.insecure = a.insecure;
  comm.bytes_per_pack = a.bytes_per_pack;
  comm.overlap = !a.no_overlap;
  comm.shared_memory = !a.no_shared_memory;
  comm.compression = collective::parse_compression(a.compression);
  comm.heartbeat_timeout = seconds_flag(a.heartbeat_timeout_s, "--heartbeat-timeout");
  // At least four beats per timeout, so one late beat on a busy machine is not a failure.
  comm.heartbeat_interval = std::min(comm.heartbeat_interval, comm.heartbeat_timeout / 4);
  return comm;
}

strategy::ElasticOptions elastic_options(const TrainArgs& a) {
  if (!a.elastic && a.elastic_batch != "global") {
    throw ConfigError("--elastic-batch " + a.elastic_batch +
                      " says what an elastic group keeps when workers leave; add --elastic");
  }
  strategy::ElasticOptions elastic;
  elastic.enabled = a.elastic;
  elastic.batch = a.elastic_batch == "per-replica" ? strategy::ElasticOptions::Batch::kPerReplica
                                                   : strategy::ElasticOptions::Batch::kGlobal;
  return elastic;
}

// Found before joining, not after an epoch of training.
void check_metrics_file(const std::string& path) {
  if (!std::ofstream(path, std::ios::app)) {
    throw ConfigError("cannot append to --metrics-json file " + path +
                      "; check that its directory exists and is writable");
  }
}

// The training and test elements, (image uint8 [C, H, W], label int64); for an image folder,
// (path, label) elements that `decode` turns into those, so that the pipeline shuffles and shards
// paths and each worker decodes only its own files.
struct Sources {
  data::Dataset train;
  data::Dataset test;
  std::optional<data::Dataset> validation; // --validation: held out of the training set
  data::MapFn decode;                      // empty: the elements are images already
  std::int64_t classes = 10;
  std::vector<std::int64_t> shape = {1, 28, 28}; // an image's
};

data::Dataset decoded(const Sources& s, const data::Dataset& d) {
  return s.decode ? d.map(s.decode, data::kAutotune) : d;
}

Sources image_folder_sources(const TrainArgs& a) {
  if (a.data_dir == data::kFashionMnistDir) {
    throw ConfigError("--dataset image-folder reads class folders: give --data-dir DIR with "
                      "DIR/train/<class>/... and DIR/test/<class>/... (or DIR/<class>/... and "
                      "--validation-split); scripts/fashion_mnist_images.py writes Fashion-MNIST "
                      "so");
  }
  data::ImageFolderOptions o;
  o.color_mode = a.color_mode == "rgb" ? data::ColorMode::kRgb : data::ColorMode::kGrayscale;
  o.image_size = {a.image_size.front(), a.image_size.back()};
  o.batch_size = 0;
  o.seed = static_cast<std::uint64_t>(a.seed);
  o.dtype = torch::kUInt8; // normalised per batch, as Fashion-MNIST's bytes are
  auto folder = [&](const std::string& dir, const std::string& subset) {
    o.validation_split = subset.empty() ? 0 : a.validation_split;
    o.subset = subset;
    return data::image_dataset_from_directory(dir, o);
  };
  const bool split = a.validation_split > 0;
  const fs::path root(a.data_dir);
  if (split && fs::is_directory(root / "train") && fs::is_directory(root / "test")) {
    throw ConfigError("--data-dir " + a.data_dir +
                      " has train/ and test/ folders: it is split "
                      "already (they would be two classes); drop --validation-split, or split "
                      "one of them (--data-dir " +
                      (root / "train").string() + ")");
  }
  if (!split && !(fs::is_directory(root / "train") && fs::is_directory(root / "test"))) {
    throw ConfigError("--data-dir " + a.data_dir +
                      " has no train/ and test/ folders; give a "
                      "directory that has them, or split its class folders with "
                      "--validation-split");
  }
  const data::ImageFolder train =
      split ? folder(a.data_dir, "training") : folder((root / "train").string(), "");
  const data::ImageFolder test =
      split ? folder(a.data_dir, "validation") : folder((root / "test").string(), "");
  if (test.class_names != train.class_names) {
    auto names = [](const std::vector<std::string>& v) {
      std::string out;
      for (const auto& n : v) out += (out.empty() ? "" : ", ") + n;
      return out;
    };
    throw ConfigError("--data-dir " + a.data_dir + ": the class folders of train/ (" +
                      names(train.class_names) + ") and test/ (" + names(test.class_names) +
                      ") differ; give both the same class folders");
  }
  return {train.files,
          test.files,
          std::nullopt,
          train.load,
          static_cast<std::int64_t>(train.class_names.size()),
          {o.color_mode == data::ColorMode::kRgb ? 3 : 1, o.image_size[0], o.image_size[1]}};
}

// --validation, as Keras's fit(validation_split=F): the last F of the training elements (in the
// source's order, before any shuffle) are held out and evaluated after each epoch; the test split
// stays for the end, so no image is reported both as validation and as test.
void hold_out_validation(const TrainArgs& a, Sources& s) {
  if (!a.validation) return;
  const double fraction =
      a.dataset == "fashion-mnist" && a.validation_split > 0 ? a.validation_split : 0.1;
  const std::int64_t n = s.train.cardinality();
  const auto held = static_cast<std::int64_t>(std::llround(static_cast<double>(n) * fraction));
  if (n <= 0 || held < 1 || held >= n) {
    throw ConfigError("--validation holds out " + std::to_string(fraction) + " of " +
                      std::to_string(n) +
                      " training images, which leaves none to train on or none to validate on; "
                      "give --validation-split a fraction that leaves both");
  }
  s.validation = s.train.skip(n - held);
  s.train = s.train.take(n - held);
}

// Loaded (and validated) before joining, so a bad path fails fast on every worker.
Sources load_sources(const TrainArgs& a) {
  Sources s = a.dataset == "image-folder"
                  ? image_folder_sources(a)
                  : Sources{data::fashion_mnist(a.data_dir, data::Split::kTrain),
                            data::fashion_mnist(a.data_dir, data::Split::kTest),
                            std::nullopt,
                            {}};
  hold_out_validation(a, s);
  return s;
}

// Each worker's replica devices: --devices as given, or --replicas-per-worker of them; by
// default several workers on one host (flotilla launch, torchrun, Slurm) split its GPUs. Before
// joining, so a bad device list fails this worker at once.
std::vector<torch::Device> replica_devices(const TrainArgs& a, const cluster::Environment& env) {
  if (a.devices != "auto" && a.replicas_per_worker > 0) {
    throw ConfigError("--devices " + a.devices + " and --replicas-per-worker " +
                      std::to_string(a.replicas_per_worker) +
                      " both choose the replicas; give one of them");
  }
  const int local_workers = cluster::local_world_size(env);
  if (a.devices != "auto") return strategy::parse_devices(a.devices);
  if (a.replicas_per_worker == 0 && local_workers > 1) {
    return strategy::local_share_of_devices(cluster::local_rank(env), local_workers);
  }
  return strategy::default_devices(a.replicas_per_worker);
}

void log_strategy(const strategy::Strategy& strategy, const TrainArgs& a,
                  const cluster::ClusterSpec& spec, const std::vector<torch::Device>& devices,
                  const Threads& threads, std::int64_t global_batch) {
  std::string rendezvous;
  if (spec.world_size > 1) {
    rendezvous = (spec.agent_store_key.empty() ? ", rendezvous "
                                               : ", rendezvous found through torchrun's agent "
                                                 "store at ") +
                 spec.rendezvous.to_string();
  }
  strategy.log().info(
      "MultiWorkerMirroredStrategy: " + std::to_string(strategy.num_workers()) + " worker(s), " +
      std::to_string(strategy.num_replicas_in_sync()) + " replica(s) in sync, global batch " +
      std::to_string(global_batch) + " (" + std::to_string(a.batch_per_replica) +
      " per replica), replicas on " + device_list(devices) + ", " + std::to_string(threads.count) +
      " thread(s) per worker (" + threads.how + "); cluster from " + spec.source + rendezvous);
  for (const auto& note : spec.notes) strategy.log().info(note);
}

data::Element normalized(data::Element e) {
  return data::Element{data::normalize_images(e[0]), e[1]};
}

// The seeds' recipe: [cache ->] shuffle -> [repeat ->] batch(drop_remainder) -> map(AUTOTUNE),
// each batch normalized and, with --augment, flipped and cropped.
data::Dataset training_batches(const TrainArgs& a, const Sources& sources,
                               std::int64_t global_batch, int worker) {
  // Image files: decoded after the shuffle of their paths (cheap, and each worker decodes only
  // the files it reads), or before a cache, which then holds the decoded images.
  const bool decode_first = sources.decode && a.cache != "none";
  data::Dataset source = decode_first ? decoded(sources, sources.train) : sources.train;
  if (a.cache == "memory") {
    source = source.cache();
  } else if (a.cache != "none") {
    // Image files are FILE-sharded: each worker caches its own, in a file of its own.
    source = source.cache(sources.decode ? a.cache + ".worker-" + std::to_string(worker) : a.cache);
  }
  // With --steps-per-epoch, epochs are step counts over an endless, reshuffled stream (Keras's
  // steps_per_epoch with repeat()); without, an epoch is one pass.
  data::Dataset shuffled = source.shuffle(a.shuffle_buffer, a.seed);
  if (a.steps_per_epoch > 0) shuffled = shuffled.repeat();
  if (sources.decode && !decode_first) shuffled = decoded(sources, shuffled);
  // Without augmentation there is nothing to key: no positions, no per-epoch seed (enumerate
  // makes a tensor per image, measurable when the pipeline shares the cores with training).
  if (!a.augment) return shuffled.batch(global_batch, true).map(normalized, data::kAutotune);
  // Elements reach augment as (positions, images, labels, seed): the positions (from
  // enumerate) key each image's augmentation, so an image is flipped and cropped the same way
  // whether its batch is split across 1 worker or 8; the seed (Dataset::random) changes each
  // epoch. Stateless: reproducible and resumable.
  auto augment = [](data::Element e) {
    const auto seed = static_cast<std::uint64_t>(e[3].item<std::int64_t>());
    torch::Tensor images = data::image::random_flip_left_right(e[1], seed, e[0]);
    images = data::image::random_crop_with_padding(images, 2, seed ^ 0x5bd1e995u, e[0]);
    return data::Element{data::normalize_images(images), e[2]};
  };
  return data::Dataset::zip(
             {shuffled.enumerate().batch(global_batch, true), data::Dataset::random(a.seed)})
      .map(augment, data::kAutotune);
}

struct Input {
  data::DistributedDataset train;          // this worker's slice of every global batch
  data::Dataset test;                      // evaluation batches
  std::optional<data::Dataset> validation; // --validation's batches
  std::int64_t steps_per_epoch;
};

// Distributed so that each worker preprocesses only its own slice of every global batch; on a
// GPU the last stage copies each batch from pinned memory while the step before it runs.
Input input_pipeline(const TrainArgs& a, const Sources& sources, strategy::Strategy& strategy,
                     const torch::Device& device, int threads, std::int64_t global_batch) {
  // The pipeline's threads share this worker's cores with training, not the whole machine.
  data::Options options;
  options.private_threadpool_size = threads;
  const data::Dataset batches =
      training_batches(a, sources, global_batch, strategy.input_context().input_pipeline_id)
          .prefetch(data::kAutotune);
  const data::Dataset to_device = device.is_cuda() ? batches.prefetch_to_device(device) : batches;
  auto train = data::distribute_dataset(to_device.with_options(options), strategy.input_context());
  // Every element counted once, the last batch short.
  const auto evaluation = [&](const data::Dataset& d) {
    return decoded(sources, d)
        .batch(global_batch)
        .map(normalized, data::kAutotune)
        .prefetch(data::kAutotune)
        .with_options(options);
  };
  data::Dataset test = evaluation(sources.test);
  std::optional<data::Dataset> validation;
  if (sources.validation) validation = evaluation(*sources.validation);
  std::int64_t steps = a.steps_per_epoch > 0 ? a.steps_per_epoch : train.cardinality();
  // FILE shards may differ by a batch: the epoch is the longest worker's (the others join with
  // empty batches), and every worker's schedule must count the same steps.
  if (a.steps_per_epoch == 0 && !train.same_steps_on_every_worker()) {
    steps = collective::agree(strategy.communicator(), true, steps).max;
  }
  if (steps < 1) {
    throw ConfigError("the global batch " + std::to_string(global_batch) +
                      " is larger than the training set; lower --batch-per-replica");
  }
  return {std::move(train), std::move(test), std::move(validation), steps};
}

// The chain as input_pipeline() builds it, in Dataset::plan()'s words, for the doctor's input
// check.
std::string input_chain(const TrainArgs& a, std::int64_t global_batch, const Input& input) {
  return a.dataset + (a.cache != "none" ? " -> cache(" + a.cache + ")" : std::string()) +
         " -> shuffle(" + std::to_string(a.shuffle_buffer) + ")" +
         (a.steps_per_epoch > 0 ? " -> repeat()" : "") + " -> batch(" +
         std::to_string(global_batch) + ") -> map(parallel=autotune" +
         (a.augment ? ", augment" : "") + ") -> prefetch(autotune); " + input.train.plan();
}

train::CompileOptions compile_options(const TrainArgs& a, const train::Recipe& recipe) {
  train::CompileOptions compile;
  compile.optimizer = recipe.optimizer;
  compile.loss.label_smoothing = a.label_smoothing;
  if (a.jit_compile != "auto") compile.jit_compile = a.jit_compile == "on";
  compile.steps_per_execution = a.steps_per_execution;
  compile.gradient_accumulation_steps = a.recipe.accumulation_steps;
  if (a.channels_last != "auto") compile.channels_last = a.channels_last == "on";
  return compile;
}

void log_recipe(const strategy::Strategy& strategy, const train::Recipe& recipe, const Input& input,
                train::Model& model, const collective::CommunicationOptions& comm,
                bool kept_freed_memory) {
  for (const auto& line : recipe.lines) strategy.log().info("recipe: " + line);
  if (const kernels::CompileReport* rewrites = model.kernel_rewrites()) {
    strategy.log().info("recipe: compile step: " + rewrites->summary());
  }
  strategy.log().info(
      std::string("recipe: memory format: ") +
      (model.channels_last()
           ? "channels-last (the model has 2-D convolutions, whose NHWC kernels are faster; "
             "--channels-last off keeps NCHW)"
           : "contiguous NCHW (" +
                 std::string(model.compile_options().channels_last
                                 ? "--channels-last off)"
                                 : "no 2-D convolutions to speed up; --channels-last on forces "
                                   "it)")));
  const auto params = model.module().parameters();
  const bool cpu = params.empty() || params.front().device().is_cpu();
  strategy.log().info(std::string("recipe: freed memory: ") +
                      (kept_freed_memory
                           ? "kept for the next step (malloc reuses blocks up to 32 MiB instead of "
                             "unmapping them and faulting in fresh pages every step; "
                             "--freed-memory release turns it off)"
                           : "released (the C library's default)"));
  strategy.log().info("input: " + input.train.plan());
  // How a CPU bucket crosses the workers (a CUDA one goes through NCCL, made on its first use).
  strategy.log().info(
      "gradients: " + model.gradient_reducer().plan() + "; overlap " +
      (comm.overlap ? "on" : "off") + ", compression " +
      std::string(collective::to_string(comm.compression)) +
      (cpu ? ", all-reduce over " + model.strategy().communicator().transport(torch::zeros({1}))
           : ""));
}

// --verbose auto: the library's rule (train::resolve_verbosity: a bar on a terminal, else a line
// per epoch), where FLOTILLA_TERMINAL says the output reaches a terminal through flotilla launch.
train::Verbosity verbosity(const TrainArgs& a, const cluster::Environment& env) {
  if (a.verbose != "auto") return static_cast<train::Verbosity>(std::stoi(a.verbose));
  return train::resolve_verbosity(env.get("FLOTILLA_TERMINAL") ? train::Verbosity::kProgressBar
                                                               : train::Verbosity::kAuto);
}

// For the doctor's "compute" item: one forward pass over 8 blank images of the data's shape,
// its products counted from their shapes (profile::counted_flops), times 3 (the backward pass
// computes two products for each of the forward's).
double train_flops_per_sample(train::Model& model, const Sources& sources) {
  std::vector<std::int64_t> shape = {8};
  shape.insert(shape.end(), sources.shape.begin(), sources.shape.end());
  const torch::Tensor blank = torch::zeros(shape);
  return 3 * profile::counted_flops([&] { model.predict(blank); }) / 8;
}

// Everything but the callbacks.
train::FitOptions fit_options(const TrainArgs& a, const cluster::Environment& env,
                              const Input& input) {
  train::FitOptions fit;
  fit.epochs = a.recipe.epochs;
  if (a.steps_per_epoch > 0) fit.steps_per_epoch = a.steps_per_epoch;
  if (input.validation) fit.validation_data = input.validation;
  fit.verbose = verbosity(a, env);
  return fit;
}

// Backups, checkpoints, TensorBoard, the CSV log and TerminateOnNaN, as the flags ask.
std::vector<std::shared_ptr<train::Callback>> callbacks(const TrainArgs& a) {
  std::vector<std::shared_ptr<train::Callback>> out;
  if (!a.backup_dir.empty()) {
    train::BackupOptions backup{a.backup_dir, a.backup_freq, true};
    backup.preemption_check_interval =
        std::chrono::milliseconds(static_cast<std::int64_t>(a.preemption_check_ms));
    for (const std::string& output :
         {a.metrics_json, a.csv_log, a.profile_json, a.trace, a.report, a.step_ledger}) {
      if (!output.empty()) backup.own_outputs.push_back(output);
    }
    out.push_back(std::make_shared<train::BackupAndRestore>(backup));
  }
  if (!a.checkpoint_dir.empty()) {
    train::ModelCheckpointOptions checkpoints;
    checkpoints.filepath = a.checkpoint_dir;
    checkpoints.max_to_keep = a.max_to_keep;
    out.push_back(std::make_shared<train::ModelCheckpoint>(checkpoints));
  }
  if (!a.tensorboard_dir.empty()) {
    out.push_back(
        std::make_shared<train::TensorBoard>(train::TensorBoardOptions{a.tensorboard_dir, 0}));
  }
  if (!a.csv_log.empty()) out.push_back(std::make_shared<train::CSVLogger>(a.csv_log));
  out.push_back(std::make_shared<train::TerminateOnNaN>());
  return out;
}

// --step-ledger: every process, chief or not, appends one line per optimizer update it
// committed, "<update> <epoch> <step in epoch> <workers> <unix time in ms> <rows of the pass
// read> <rows trained> <generation>", flushed at once so a killed process's lines stay; the
// generation (elastic; 0 otherwise) is the membership that decided the update. Across all processes
// of a run (restarted ones too), the lines say which global batch each update trained on, and
// when: bench/chaos.sh counts global batches lost or trained twice, and times each epoch. With
// --elastic-batch per-replica (`rows`) an update trains on a varying number of rows: the input's
// position in rows after it (the sixth field) and the model's count of rows trained (the
// seventh) say which rows of its epoch it took; both are -1 otherwise (not read every step).
std::shared_ptr<train::Callback> step_ledger(const std::string& dir, train::Model& model,
                                             bool rows) {
  const std::string path = dir + "/ledger-" + std::to_string(::getpid()) + ".txt";
  auto out = std::make_shared<std::ofstream>(path, std::ios::app);
  if (!*out) {
    throw ConfigError("cannot write --step-ledger file " + path +
                      "; check that the directory exists and is writable");
  }
  auto ledger = std::make_shared<train::LambdaCallback>();
  ledger->batch_end = [out, &model, rows](std::int64_t batch, const train::Logs&) {
    const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::system_clock::now().time_since_epoch());
    std::int64_t read = -1, trained = -1;
    if (rows) {
      const train::TrainingState state = model.training_state();
      if (state.iterator) read = state.iterator->produced; // in rows in this mode
      trained = state.trained_rows;
    }
    const auto* group = model.strategy().elastic();
    *out << model.iterations() << ' ' << model.current_epoch() << ' ' << batch << ' '
         << model.strategy().num_workers() << ' ' << now.count() << ' ' << read << ' ' << trained
         << ' ' << (group ? group->generation() : 0) << std::endl;
  };
  return ledger;
}

// The chief's --metrics-json line per epoch.
std::shared_ptr<train::Callback> metrics_lines(const std::string& path, train::Model& model,
                                               std::int64_t global_batch, train::Policy policy) {
  auto metrics = std::make_shared<train::LambdaCallback>();
  metrics->epoch_end = [path, &model, global_batch, policy](int, train::EpochLogs& logs) {
    const strategy::Strategy& strategy = model.strategy();
    nlohmann::ordered_json line = {{"epoch", logs.epoch}};
    for (const auto& [key, value] : logs.values.items()) line[key] = value;
    line.update({{"samples_per_s", logs.samples_per_s},
                 {"seconds", logs.seconds},
                 {"input_bound_share", logs.phases.input_share()},
                 {"steps", logs.steps},
                 {"skipped_steps", logs.skipped_steps},
                 // Optimizer updates so far: a resumed run must count as many as one never
                 // interrupted, none lost and none done twice.
                 {"iterations", model.iterations()},
                 {"comm_seconds", logs.phases.comm_seconds},
                 // The all-reduce wait after backward; 0 when nothing crossed a network.
                 {"comm_exposed_seconds",
                  logs.phases.comm_seconds > 0 ? logs.phases[train::Phase::kAllReduce] : 0.0},
                 {"comm_hidden_share", logs.phases.hidden_share()},
                 {"workers", strategy.num_workers()},
                 {"replicas_in_sync", strategy.num_replicas_in_sync()},
                 {"global_batch", global_batch},
                 {"precision", train::to_string(policy)}});
    append_json_line(path, line);
  };
  return metrics;
}

profile::ProfilerOptions profiler_options(const TrainArgs& a, const train::Recipe& recipe,
                                          std::int64_t global_batch, int threads,
                                          const cluster::Environment& env, const Input& input,
                                          train::Verbosity verbose) {
  profile::ProfilerOptions profiling;
  profiling.trace = a.trace;
  profiling.summary = a.profile_json;
  profiling.report = a.report;
  profiling.doctor = !a.no_doctor && verbose != train::Verbosity::kSilent;
  profiling.command = a.command;
  // The doctor's warmup advice is an epoch's steps; --warmup-epochs counts epochs.
  profiling.findings_format = cli_findings_format(input.steps_per_epoch);
  profile::RecipeFacts& facts = profiling.recipe;
  facts.model = a.model;
  facts.batch_per_replica = a.batch_per_replica;
  facts.global_batch = global_batch;
  facts.base_lr = a.recipe.lr > 0 ? 0 : a.recipe.base_lr;
  facts.base_batch = a.recipe.lr > 0 ? 0 : a.recipe.base_batch;
  facts.lr_scaling = a.recipe.lr > 0 ? "as given" : a.recipe.lr_scaling;
  facts.peak_lr = recipe.peak_lr;
  facts.schedule = a.recipe.schedule;
  facts.warmup_steps = recipe.warmup_steps;
  facts.total_steps = recipe.total_steps;
  facts.threads_per_worker = threads;
  facts.cores = base::available_cores();
  facts.local_workers = cluster::local_world_size(env);
  facts.input_pipeline = input_chain(a, global_batch, input);
  return profiling;
}

// Evaluation on the test split (every worker takes part); the chief prints it and, with
// `metrics_json`, appends it there.
void evaluate_on_test(train::Model& model, const data::Dataset& test,
                      const std::string& metrics_json) {
  const train::EvalResult result = model.evaluate(test);
  if (!model.strategy().is_chief()) return;
  std::printf("Test: loss: %.4f - accuracy: %.4f (%lld samples)\n", result.loss(),
              result.at("accuracy"), static_cast<long long>(result.samples));
  std::fflush(stdout);
  if (!metrics_json.empty()) {
    append_json_line(metrics_json, {{"test_loss", result.loss()},
                                    {"test_accuracy", result.at("accuracy")},
                                    {"test_samples", result.samples}});
  }
}

bool is_zoo_model(const std::string& model) {
  const auto& names = models::model_names();
  return std::find(names.begin(), names.end(), model) != names.end();
}

// The zoo's model, its BatchNorms synchronised with --sync-batchnorm (`log`: where to say that a
// model without BatchNorm has nothing to synchronise).
torch::nn::Sequential build_zoo_model(const TrainArgs& a, const Logger* log = nullptr) {
  auto net = models::make_model(a.model);
  if (!a.sync_batchnorm) return net;
  auto converted = train::convert_sync_batchnorm(net);
  if (converted.ptr() == net.ptr() && log) {
    log->warn("--sync-batchnorm: " + a.model + " has no BatchNorm; nothing to synchronise");
  }
  return converted;
}

// --model PATH: a TorchScript module, loaded and run once on two of `source`'s elements, as
// training will see them, before this worker joins: a file that is not a module, or a forward
// that fails on the data, is one line and exit 2 on every worker, and no collective waits.
train::TorchScriptModule load_script_model(const TrainArgs& a, const Sources& sources,
                                           const data::Dataset& source) {
  train::TorchScriptModule script = train::load_torchscript(a.model);
  if (a.sync_batchnorm && script->convert_sync_batchnorm() == 0) {
    Logger().warn("--sync-batchnorm: " + a.model + " calls no batch_norm; nothing to synchronise");
  }
  const std::optional<data::Element> sample =
      decoded(sources, source.take(2)).batch(2).map(normalized).make_iterator().next();
  if (!sample) return script;
  const torch::Tensor out = train::check_forward(script, (*sample)[0]);
  if (out.dim() != 2 || out.size(1) < sources.classes) {
    std::ostringstream shape;
    shape << out.sizes();
    throw ConfigError(a.model + ": forward returns " + shape.str() + " for a batch of 2; the " +
                      "data has " + std::to_string(sources.classes) +
                      " classes, so it must return [batch, " + std::to_string(sources.classes) +
                      "] logits");
  }
  return script;
}

// The zoo's models take Fashion-MNIST's shape: say so before joining, not in the first step.
void check_zoo_fits(const TrainArgs& a, const Sources& sources) {
  if (sources.shape == std::vector<std::int64_t>{1, 28, 28} && sources.classes <= 10) return;
  throw ConfigError("--model " + a.model +
                    " takes 1x28x28 images of up to 10 classes; the data "
                    "has " +
                    std::to_string(sources.classes) + " classes of " +
                    std::to_string(sources.shape[0]) + "x" + std::to_string(sources.shape[1]) +
                    "x" + std::to_string(sources.shape[2]) +
                    " (--color-mode, --image-size): train a TorchScript module of your own "
                    "(--model PATH), or use --color-mode grayscale --image-size 28");
}

// --batch-per-replica against this host's memory, before a batch of that size is allocated
// anywhere: from --batch-per-replica kMemoryChecked, a zoo model on the CPU. Two training steps
// of the model at small batches (the step probe of `flotilla tune`: the process's resident peak)
// give its bytes per sample, extrapolated to the batch; more than MemAvailable / (workers on
// this host x replicas per worker) is one line and exit 2 on every worker, before joining.
// (Before: the batch grew until std::bad_alloc, or the kernel's OOM killer, mid-start.)
constexpr std::int64_t kMemoryChecked = 1024;
void check_batch_fits_memory(const TrainArgs& a, const cluster::Environment& env,
                             const std::vector<torch::Device>& devices) {
  if (a.batch_per_replica < kMemoryChecked || !is_zoo_model(a.model)) return;
  if (devices.front().type() != torch::kCPU) return; // CUDA: the allocator says so in the step
  const cluster::LocalWorkers local = cluster::local_workers(env);
  const int replicas = static_cast<int>(devices.size());
  const std::int64_t host_available = profile::default_memory_budget(1, 1.0); // MemAvailable
  const std::int64_t available = host_available / (local.count * replicas);
  profile::StepProbeOptions options;
  options.model = [&a] { return profile::probe_model(models::make_model(a.model)); };
  options.precision =
      train::to_string(train::choose_precision(a.recipe.precision, devices.front()).first);
  options.optimizer = a.recipe.optimizer;
  options.memory_budget_bytes = std::numeric_limits<std::int64_t>::max();
  const profile::FitsFn step = profile::step_probe(options);
  constexpr std::int64_t kSmall = 64, kLarge = 128;
  const std::int64_t small = step(kSmall).peak_bytes;
  const std::int64_t large = step(kLarge).peak_bytes;
  const double per_sample =
      std::max<double>(0, static_cast<double>(large - small) / (kLarge - kSmall));
  const double needed =
      static_cast<double>(large) + per_sample * static_cast<double>(a.batch_per_replica - kLarge);
  if (needed <= static_cast<double>(available)) return;
  throw ConfigError("--batch-per-replica " + std::to_string(a.batch_per_replica) +
                    ": a training step of " + a.model + " (" + options.precision +
                    ") needs about " + profile::format_bytes(static_cast<std::int64_t>(needed)) +
                    " per replica (measured: " + profile::format_bytes(small) + " at " +
                    std::to_string(kSmall) + ", " + profile::format_bytes(large) + " at " +
                    std::to_string(kLarge) + ", extrapolated), and this host has " +
                    profile::format_bytes(available) + " for each replica: MemAvailable " +
                    profile::format_bytes(host_available) + " / " + std::to_string(local.count) +
                    " worker(s) on this host (" + local.source + ") / " + std::to_string(replicas) +
                    " replica(s) each; lower it (`flotilla tune --max-batch --model " + a.model +
                    "` finds the largest that fits)");
}

// --model: the zoo's model (checked against the data) or a TorchScript module (loaded and run).
train::TorchScriptModule script_model(const TrainArgs& a, const Sources& sources,
                                      const data::Dataset& source) {
  if (!is_zoo_model(a.model)) return load_script_model(a, sources, source);
  check_zoo_fits(a, sources);
  return train::TorchScriptModule(nullptr);
}

// The model --model names, built in the strategy's scope (a TorchScript module: `script`, loaded
// before joining).
std::unique_ptr<train::Model> make_model(strategy::Strategy& strategy, const TrainArgs& a,
                                         const train::TorchScriptModule& script) {
  if (script) return std::make_unique<train::Model>(strategy, script);
  auto net = strategy.scope(
      [&] { return build_zoo_model(a, strategy.is_chief() ? &strategy.log() : nullptr); });
  return std::make_unique<train::Model>(strategy, net);
}

// The evaluator task (TF_CONFIG task.type "evaluator"): TF's SidecarEvaluator on the chief's
// checkpoint directory, with its own TensorBoard scalars (<tensorboard-dir>/evaluation) and
// metrics lines; it ends after the checkpoint of the last epoch.
int run_evaluator(const TrainArgs& a) {
  if (a.checkpoint_dir.empty()) {
    throw ConfigError("this task is the evaluator (TF_CONFIG task.type \"evaluator\"): it "
                      "evaluates the chief's checkpoints, so give it --checkpoint-dir, the same "
                      "as the chief's");
  }
  const Sources sources = load_sources(a);
  const data::Dataset test =
      decoded(sources, sources.test).batch(a.batch_per_replica * 4).map(normalized);
  // This process alone, on the first of --devices (evaluation runs one replica).
  const std::vector<torch::Device> devices =
      a.devices == "auto" ? strategy::default_devices() : strategy::parse_devices(a.devices);
  strategy::MirroredStrategy strategy(std::vector<torch::Device>{devices.front()});
  const train::TorchScriptModule script = script_model(a, sources, sources.test);
  const std::unique_ptr<train::Model> owned = make_model(strategy, a, script);
  train::Model& model = *owned;
  train::SidecarEvaluatorOptions options;
  // --precision given: every checkpoint is evaluated under it; auto: under the policy each
  // checkpoint was trained in (its manifest says), as the chief measured it.
  if (a.recipe.precision != "auto") {
    train::set_global_policy(train::parse_policy(a.recipe.precision));
    options.use_checkpoint_policy = false;
  }
  model.compile({});
  options.checkpoint_dir = a.checkpoint_dir;
  if (!a.tensorboard_dir.empty()) options.log_dir = fs::path(a.tensorboard_dir) / "evaluation";
  options.timeout = seconds_flag(a.timeout_s, "--timeout");
  options.last_epoch = a.recipe.epochs;
  options.on_result = [&a](const train::SidecarResult& r) {
    std::printf("Evaluator: %s (epoch %lld, step %lld): loss: %.4f - accuracy: %.4f\n",
                r.checkpoint.filename().c_str(), static_cast<long long>(r.epoch),
                static_cast<long long>(r.step), r.result.loss(), r.result.at("accuracy"));
    std::fflush(stdout);
    if (!a.metrics_json.empty()) {
      append_json_line(a.metrics_json, {{"evaluator_checkpoint", r.checkpoint.filename().string()},
                                        {"epoch", r.epoch},
                                        {"step", r.step},
                                        {"eval_loss", r.result.loss()},
                                        {"eval_accuracy", r.result.at("accuracy")}});
    }
  };
  std::printf("Evaluator: watching %s for checkpoints\n", a.checkpoint_dir.c_str());
  std::fflush(stdout);
  train::SidecarEvaluator(model, test, options).start();
  return kExitOk;
}

// --shares auto: steps between two measurements of the workers' speeds.
constexpr std::int64_t kBalanceSharesEvery = 20;

// --shares: "equal" or "auto" (none to start with), or one whole weight per worker of the
// `workers`, "2,1"; checked before joining.
std::vector<std::int64_t> parse_shares(const std::string& text, int workers) {
  if (text == "equal" || text == "auto") return {};
  std::vector<std::int64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    std::int64_t weight = 0;
    try {
      weight = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || weight < 1 || weight > cluster::kMaxShareWeight) {
      throw ConfigError("--shares: \"" + item + "\" is not a whole number from 1 to " +
                        std::to_string(cluster::kMaxShareWeight) +
                        "; write equal, auto, or one weight per worker in task order, e.g. 2,1");
    }
    out.push_back(weight);
  }
  if (static_cast<int>(out.size()) != workers) {
    throw ConfigError("--shares gives " + std::to_string(out.size()) + " weight(s) for " +
                      std::to_string(workers) + " worker(s); give one per worker, in task order " +
                      "(the chief first), e.g. " + (workers == 2 ? "2,1" : "equal"));
  }
  return out;
}

// What --shares comes to on `strategy`'s workers: the mode the fit runs (auto, equal, or the
// weights) and its recipe line. Left out, it is auto wherever dividing by speed can
// (train::why_no_shares_by_speed), equal elsewhere, saying why.
struct SharesChoice {
  std::string mode;
  std::string line; // "" on one worker: nothing to divide
};

SharesChoice resolve_shares(const TrainArgs& a, const strategy::Strategy& strategy,
                            const Input& input) {
  const std::string by_speed =
      "each worker's compute time per row is measured every " +
      std::to_string(kBalanceSharesEvery) +
      " steps and each global batch divided in proportion, where that cuts a step's compute by "
      "more than 5% (the global batch, learning rate and update stay those of equal shares)";
  if (a.shares_given && a.shares == "auto")
    return {"auto", "by speed (--shares auto): " + by_speed};
  if (strategy.num_workers() == 1) return {a.shares_given ? a.shares : "equal", ""};
  const std::string why = train::why_no_shares_by_speed(strategy, input.train);
  if (a.shares_given && a.shares == "equal") {
    return {"equal", why.empty() ? "equal (--shares equal; the chief says once if dividing by "
                                   "speed would make a step's compute 10% faster or more)"
                                 : "equal (--shares equal)"};
  }
  if (a.shares_given)
    return {a.shares, "fixed weights " + a.shares + " (--shares), the chief first"};
  if (!why.empty()) return {"equal", "equal (" + why + ")"};
  return {"auto", "by speed (the default on more than one worker; --shares equal for reruns that "
                  "repeat bit for bit): " +
                      by_speed};
}

int run(const TrainArgs& a) {
  const auto env = cluster::Environment::from_process();
  const cluster::ClusterSpec spec = cluster::resolve_cluster(env);
  check_dataset(a);
  const Threads threads = threads_per_worker(a, env);
  torch::set_num_threads(threads.count);
  kernels::set_mode(kernels::parse_mode(a.kernels));
  if (!a.kernel_cache.empty()) kernels::set_cache_directory(a.kernel_cache);
  const bool kept_freed_memory = a.freed_memory == "keep" && base::keep_freed_memory();
  const collective::CommunicationOptions comm = communication_options(a, env);
  const strategy::ElasticOptions elastic = elastic_options(a);
  if (spec.is_evaluator()) return run_evaluator(a);
  const std::string metrics_json = spec.is_chief() ? a.metrics_json : "";
  if (!metrics_json.empty()) check_metrics_file(metrics_json);
  const Sources sources = load_sources(a);
  const train::TorchScriptModule script = script_model(a, sources, sources.train);
  const std::vector<torch::Device> devices = replica_devices(a, env);
  check_batch_fits_memory(a, env, devices);
  const std::vector<std::int64_t> shares = parse_shares(a.shares, spec.world_size);
  if (a.elastic && !shares.empty()) {
    throw ConfigError("--shares " + a.shares +
                      ": fixed weights name workers in task order, and an elastic group's "
                      "members change; with --elastic, use --shares auto (measured anew at every "
                      "change) or equal");
  }

  strategy::MultiWorkerMirroredStrategy strategy(spec, comm, devices, elastic);
  strategy.set_shares(shares);
  // Elastic: the global batch is the whole cluster's, whoever is in the group now, so the
  // learning rate and the schedule stay as planned while workers come and go.
  const std::int64_t global_batch =
      a.batch_per_replica * (a.elastic ? spec.world_size * static_cast<int>(devices.size())
                                       : strategy.num_replicas_in_sync());
  if (strategy.is_chief()) log_strategy(strategy, a, spec, devices, threads, global_batch);
  if (strategy.is_chief() && sources.validation) {
    const std::int64_t held = sources.validation->cardinality();
    strategy.log().info("validation: the last " + std::to_string(held) + " of " +
                        std::to_string(held + sources.train.cardinality()) +
                        " training images held out, evaluated after each epoch (Keras's "
                        "validation_split); the test split is evaluated once, at the end");
  }
  const Input input =
      input_pipeline(a, sources, strategy, devices.front(), threads.count, global_batch);
  // The recipe, item by item (the seeds' list): each is on by default where it helps here.
  const train::Recipe recipe = make_recipe(a, global_batch, input.steps_per_epoch, devices.front());
  train::set_global_policy(recipe.policy);
  torch::manual_seed(a.seed);
  const std::unique_ptr<train::Model> owned = make_model(strategy, a, script);
  train::Model& model = *owned;
  model.compile(compile_options(a, recipe));
  if (strategy.is_chief()) log_recipe(strategy, recipe, input, model, comm, kept_freed_memory);

  train::FitOptions fit = fit_options(a, env, input);
  const SharesChoice shares_choice = resolve_shares(a, strategy, input);
  if (strategy.is_chief() && !shares_choice.line.empty()) {
    strategy.log().info("recipe: shares: " + shares_choice.line);
  }
  if (shares_choice.mode == "auto") fit.balance_shares_every = kBalanceSharesEvery;
  // Equal shares chosen: measured all the same, and the chief says once what auto would gain.
  if (a.shares_given && a.shares == "equal" && spec.world_size > 1) {
    fit.advise_shares_every = kBalanceSharesEvery;
  }
  fit.straggler_floor = a.straggler_floor;
  fit.callbacks = callbacks(a);
  if (!metrics_json.empty()) {
    fit.callbacks.push_back(metrics_lines(metrics_json, model, global_batch, recipe.policy));
  }
  if (strategy.is_chief()) {
    // What ran for each kind of layer, once the first steps have met every shape.
    auto kernel_lines = std::make_shared<train::LambdaCallback>();
    kernel_lines->batch_end = [&strategy, done = false](std::int64_t, const train::Logs&) mutable {
      if (std::exchange(done, true)) return;
      for (const auto& line : kernels::summary_lines()) strategy.log().info("recipe: " + line);
    };
    fit.callbacks.push_back(kernel_lines);
  }
  if (!a.step_ledger.empty()) {
    if (a.steps_per_execution != 1) {
      throw ConfigError("--step-ledger writes a line per step, and --steps-per-execution " +
                        std::to_string(a.steps_per_execution) +
                        " calls it every that many steps; leave --steps-per-execution at 1");
    }
    fit.callbacks.push_back(step_ledger(a.step_ledger, model, a.elastic_batch == "per-replica"));
  }
  profile::ProfilerOptions profiling =
      profiler_options(a, recipe, global_batch, threads.count, env, input, fit.verbose);
  profiling.recipe.shares = shares_choice.mode;
  profiling.recipe.shares_refused = train::why_no_shares_by_speed(strategy, input.train);
  const bool reported = profiling.doctor || !a.profile_json.empty() || !a.report.empty();
  if (strategy.is_chief() && reported) {
    profiling.recipe.train_flops_per_sample = train_flops_per_sample(model, sources);
  }
  fit.callbacks.push_back(std::make_shared<profile::Profiler>(profiling));
  model.fit(input.train, fit);
  for (const auto& callback : fit.callbacks) {
    const auto* nan = dynamic_cast<const train::TerminateOnNaN*>(callback.get());
    if (nan && !nan->terminated().empty()) {
      // No test result of a diverged model, and no exit 0: a scheduler must see it failed.
      strategy.log().error(
          "the training diverged (" + nan->terminated() +
          "): it stopped there, and no checkpoint or backup of the non-finite weights was "
          "written. Lower --lr (or use --global-clipnorm, --warmup-epochs), then resume "
          "from the last backup or start again");
      return kExitDiverged;
    }
  }
  evaluate_on_test(model, input.test, metrics_json);
  return kExitOk;
}

// What to train on: the model, the dataset and its input pipeline.
void add_data_flags(CLI::App* app, TrainArgs& args) {
  app->add_option("--model", args.model,
                  "mlp, mlp-wide, cnn, resnet20, resnet18, vit-tiny, or the path of a TorchScript "
                  "module (torch.jit.script(model).save(\"model.pt\"))")
      ->check(CLI::IsMember(models::model_names()) | CLI::ExistingFile)
      ->capture_default_str();
  app->add_option("--dataset", args.dataset,
                  "fashion-mnist (IDX files) or image-folder (JPEG/PNG files in class folders)")
      ->check(CLI::IsMember({"fashion-mnist", "image-folder"}))
      ->capture_default_str();
  app->add_option("--data-dir", args.data_dir,
                  "fashion-mnist: the IDX files' directory; image-folder: DIR with train/<class>/ "
                  "and test/<class>/, or DIR/<class>/ with --validation-split")
      ->capture_default_str();
  app->add_option("--validation-split", args.validation_split,
                  "image-folder DIR/<class>/: test on this fraction of DIR's images (Keras's "
                  "validation subset, seeded with --seed), train on the rest; fashion-mnist with "
                  "--validation: the fraction of training images held out (default 0.1)")
      ->check(number_in(0.0, 1.0))
      ->capture_default_str();
  app->add_option("--image-size", args.image_size,
                  "image-folder: HEIGHT [WIDTH] every image is resized to (bilinear)")
      ->expected(1, 2)
      ->check(positive_number(16384))
      ->capture_default_str();
  app->add_option("--color-mode", args.color_mode, "image-folder: grayscale or rgb")
      ->check(CLI::IsMember({"grayscale", "rgb"}))
      ->capture_default_str();
  app->add_flag("--validation", args.validation,
                "Hold out the last 10% of the training images (Keras's validation_split) and "
                "evaluate on them after each epoch (val_loss, val_accuracy); the test split is "
                "kept for the end");
  app->add_option("--shuffle-buffer", args.shuffle_buffer, "Elements in the shuffle buffer")
      ->check(positive_number(1 << 26))
      ->capture_default_str();
  app->add_option("--cache", args.cache,
                  "Cache the decoded training set: none, memory, or a file path prefix")
      ->capture_default_str();
  app->add_flag("--augment", args.augment,
                "Random flip left-right and random crop (padding 2), seeded per batch");
}

// How long and how: batch, optimizer, learning-rate schedule, loss, seed.
void add_recipe_flags(CLI::App* app, TrainArgs& args) {
  app->add_option("--epochs", args.recipe.epochs, "Epochs to train")
      ->check(positive_number(1e6))
      ->capture_default_str();
  app->add_option("--steps-per-epoch", args.steps_per_epoch,
                  "Steps per epoch (0: the whole dataset)")
      ->check(non_negative_number(1e12))
      ->capture_default_str();
  app->add_option("--batch-per-replica", args.batch_per_replica,
                  "Batch per replica; global batch = this x replicas in sync")
      ->check(positive_number(1 << 20))
      ->capture_default_str();
  app->add_option("--optimizer", args.recipe.optimizer, "sgd (momentum), adam or adamw")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->capture_default_str();
  app->add_option("--base-lr", args.recipe.base_lr, "Learning rate per --base-batch examples")
      ->check(positive_number(1000))
      ->capture_default_str();
  app->add_option("--base-batch", args.recipe.base_batch, "The batch --base-lr is meant for")
      ->check(positive_number(1 << 30))
      ->capture_default_str();
  app->add_option("--lr-scaling", args.recipe.lr_scaling,
                  "linear: peak rate = base-lr x global batch / base-batch; none: base-lr")
      ->check(CLI::IsMember({"linear", "none"}))
      ->capture_default_str();
  app->add_option("--lr", args.recipe.lr,
                  "Peak learning rate as given (overrides --base-lr scaling)")
      ->check(positive_number(1000));
  app->add_option("--schedule", args.recipe.schedule,
                  "cosine (warmup, then cosine decay) or constant")
      ->check(CLI::IsMember({"cosine", "constant"}))
      ->capture_default_str();
  app->add_option("--warmup-epochs", args.recipe.warmup_epochs,
                  "Linear warmup from 0 to the peak rate (default: 1 when epochs > 1, else 0)")
      ->check(non_negative_number(1e6));
  app->add_option("--momentum", args.recipe.momentum, "SGD momentum")
      ->check(number_in(0.0, 0.999))
      ->capture_default_str();
  app->add_option("--weight-decay", args.recipe.weight_decay,
                  "L2 weight decay (SGD, Adam; AdamW: decoupled); default 0, AdamW 0.004")
      ->check(number_in(0.0, 1.0));
  app->add_option("--global-clipnorm", args.recipe.global_clipnorm,
                  "Clip the gradients to this global L2 norm before each update, after the "
                  "all-reduce (Keras's global_clipnorm, PyTorch's clip_grad_norm_); 0: off")
      ->check(non_negative_number(1e9))
      ->capture_default_str();
  app->add_option("--label-smoothing", args.label_smoothing, "Cross-entropy label smoothing")
      ->check(number_in(0.0, 1.0))
      ->capture_default_str();
  app->add_option("--accumulation-steps", args.recipe.accumulation_steps,
                  "Batches whose gradients are summed before one all-reduce and optimizer step")
      ->check(number_in(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--seed", args.seed, "Seed for initialisation and shuffling")
      ->check(number_in(0, 9007199254740992.0)) // 2^53: every such seed reads back exactly
      ->capture_default_str();
}

// How fast: precision, memory layout, compiled steps, threads and replicas.
void add_performance_flags(CLI::App* app, TrainArgs& args) {
  app->add_option("--precision", args.recipe.precision,
                  "auto (mixed_bfloat16 where the CPU computes bf16 natively), float32, "
                  "mixed_float16 or mixed_bfloat16")
      ->check(CLI::IsMember({"auto", "float32", "mixed_float16", "mixed_bfloat16"}))
      ->capture_default_str();
  app->add_option("--channels-last", args.channels_last,
                  "Keep the model's 2-D convolution weights and activations channels-last "
                  "(NHWC): auto (on for models with 2-D convolutions), on or off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app->add_option("--freed-memory", args.freed_memory,
                  "What malloc does with the memory a step frees: keep (blocks up to 32 MiB are "
                  "reused by the next step instead of being unmapped and faulted in again) or "
                  "release (the C library's default)")
      ->check(CLI::IsMember({"keep", "release"}))
      ->capture_default_str();
  app->add_flag("--sync-batchnorm", args.sync_batchnorm,
                "SyncBatchNorm: BatchNorm statistics over the whole global batch, across replicas "
                "and workers (train::convert_sync_batchnorm)");
  // Keras's jit_compile="auto" unless one of these is given.
  app->add_flag_callback(
      "--jit-compile", [&args] { args.jit_compile = "on"; },
      "Keras's jit_compile=True: on CUDA the step in a CUDA graph; on the CPU "
      "the compile step, as by default (it rewrites the model for flotilla's "
      "kernels)");
  app->add_flag_callback(
      "--no-jit-compile", [&args] { args.jit_compile = "off"; },
      "Keras's jit_compile=False: the model runs as written (no compile step)");
  app->add_option("--kernels", args.kernels,
                  "flotilla's CPU kernels against ATen's: measure (time both at each shape at "
                  "first use, keep the faster, cache the choice for the next run), fixed "
                  "(flotilla's wherever they apply: bit-reproducible across CPUs), none (ATen's)")
      ->check(CLI::IsMember({"measure", "fixed", "none"}))
      ->capture_default_str();
  app->add_option("--kernel-cache", args.kernel_cache,
                  "Where measured kernel choices are kept (default: FLOTILLA_CACHE_DIR, else "
                  "$XDG_CACHE_HOME/flotilla, else ~/.cache/flotilla)");
  app->add_option("--steps-per-execution", args.steps_per_execution,
                  "Steps between batch-level callbacks and progress updates")
      ->check(number_in(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--threads", args.threads,
                  "Intra-op threads per worker (0: cores / workers on this machine)")
      ->check(non_negative_number(4096))
      ->capture_default_str();
  app->add_option("--replicas-per-worker", args.replicas_per_worker,
                  "Model replicas per worker, reduced locally before the all-reduce: the first N "
                  "GPUs, or N CPU replicas (threads) without a GPU; 0: one per --devices entry")
      ->check(number_in(0, 64))
      ->capture_default_str();
  app->add_option("--devices", args.devices,
                  "Each worker's replica devices: auto (every visible GPU, else the CPU), cpu, "
                  "cuda, or a list such as cuda:0,cuda:1")
      ->capture_default_str();
}

// What is written: checkpoints, backups, logs, profiles and reports.
void add_output_flags(CLI::App* app, TrainArgs& args) {
  app->add_option("--checkpoint-dir", args.checkpoint_dir,
                  "Full checkpoints after each epoch: <dir>/ckpt-<epoch> (safetensors, optimizer "
                  "state, manifest) and TF's 'checkpoint' pointer (chief; others use temp dirs)");
  app->add_option("--max-to-keep", args.max_to_keep, "Checkpoints kept in --checkpoint-dir")
      ->check(number_in(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--backup-dir", args.backup_dir,
                  "BackupAndRestore: resume an interrupted run from here; removed when done");
  app->add_option("--backup-freq", args.backup_freq,
                  "Also back up every N optimizer updates (0: at epoch ends only)")
      ->check(non_negative_number(1e12))
      ->capture_default_str();
  app->add_option("--preemption-check-ms", args.preemption_check_ms,
                  "With --backup-dir, SIGTERM to any worker makes all save a backup at one step "
                  "and exit 75; they compare notes about this often (0: every step)")
      ->check(number_in(0.0, 3600e3))
      ->capture_default_str();
  app->add_option("--tensorboard-dir", args.tensorboard_dir,
                  "TensorBoard event files: <dir>/train and <dir>/validation (chief)");
  app->add_option("--csv-log", args.csv_log, "CSVLogger: one row per epoch (chief)");
  app->add_option("--metrics-json", args.metrics_json,
                  "Chief appends one JSON object per epoch and one with the test result");
  app->add_option("--step-ledger", args.step_ledger,
                  "Directory where every process appends ledger-<pid>.txt: one line per "
                  "optimizer update, \"update epoch step workers unix_ms\" (bench/chaos.sh counts "
                  "them)");
  app->add_option("--profile-json", args.profile_json,
                  "Write the run's profile (per-epoch values, step phases per worker, the "
                  "recipe) as JSON, for flotilla plan --profile (chief)");
  app->add_option("--trace", args.trace,
                  "Write the timeline: every worker's step phases as one Chrome trace-event JSON "
                  "file (Perfetto, chrome://tracing), gathered on the chief");
  app->add_option("--report", args.report,
                  "Write a self-contained HTML report: curves, step-time breakdown per worker, "
                  "the recipe checklist (chief)");
  app->add_flag("--no-doctor", args.no_doctor,
                "Do not print the recipe doctor's findings at the end of training");
  app->add_option("--verbose", args.verbose,
                  "auto (bar on a terminal, else a line per epoch), 0, 1 (bar) or 2 (line)")
      ->check(CLI::IsMember({"auto", "0", "1", "2"}))
      ->capture_default_str();
}

// The group: authentication, elastic mode, timeouts and the collectives.
void add_cluster_flags(CLI::App* app, TrainArgs& args) {
  app->add_option("--cluster-token-file", args.cluster_token_file,
                  "File holding the cluster token (mode 600); the chief admits only tasks that "
                  "hold the same token (default: FLOTILLA_CLUSTER_TOKEN or "
                  "FLOTILLA_CLUSTER_TOKEN_FILE; none: no authentication, refused across hosts)");
  app->add_flag("--insecure", args.insecure,
                "Without a cluster token, run a job across hosts anyway (anyone who reaches the "
                "rendezvous could join it)");
  app->add_flag("--elastic", args.elastic,
                "Elastic group (needs FLOTILLA_RENDEZVOUS: flotilla launch --elastic, or flotilla "
                "rendezvous): a failed worker is dropped and the others go on with the same "
                "global batch; a restarted one rejoins from a live peer's memory");
  app->add_option("--shares", args.shares,
                  "How each global batch divides among the workers: auto (by each worker's "
                  "measured compute time per row, every 20 steps; the default wherever the input "
                  "can move rows between workers); equal (reruns repeat bit for bit); or one "
                  "whole weight per worker in task order (2,1: the chief takes 2/3 of every "
                  "global batch). The global batch, the learning rate and the update stay as "
                  "with equal shares")
      ->each([&args](const std::string&) { args.shares_given = true; })
      ->capture_default_str();
  app->add_option("--straggler-floor", args.straggler_floor,
                  "With --shares auto: a worker measured below this fraction of the median "
                  "worker's speed (twice in a row) is a straggler; with --elastic it leaves and "
                  "the others go on without it, otherwise the chief warns. 0: never")
      ->check(number_in(0, 0.99))
      ->capture_default_str();
  app->add_option("--elastic-batch", args.elastic_batch,
                  "With --elastic, what stays when workers leave: global (the global batch and "
                  "the learning rate; each survivor's batch grows) or per-replica (each worker's "
                  "batch; the learning rate scales with the rows each step has)")
      ->check(CLI::IsMember({"global", "per-replica"}))
      ->capture_default_str();
  app->add_option("--heartbeat-timeout", args.heartbeat_timeout_s,
                  "Seconds of silence after which a worker counts as failed (stopped, hung, cut "
                  "off)")
      ->check(number_in(0.1, 3600.0))
      ->capture_default_str();
  app->add_option("--timeout", args.timeout_s, "Seconds any rendezvous or collective may take")
      ->check(number_in(0.1, 7 * 86400.0))
      ->capture_default_str();
  app->add_option("--implementation", args.implementation,
                  "Collective implementation: auto, ring or nccl")
      ->check(CLI::IsMember({"auto", "ring", "nccl"}, CLI::ignore_case))
      ->capture_default_str();
  app->add_option("--bytes-per-pack", args.bytes_per_pack, "Gradient bucket size in bytes")
      ->check(positive_number(1 << 30))
      ->capture_default_str();
  app->add_flag("--no-overlap", args.no_overlap,
                "Start the gradient all-reduces after backward instead of during it");
  app->add_option("--compression", args.compression,
                  "Gradients on the wire: none, fp16 or bf16 (half the bytes)")
      ->check(CLI::IsMember({"none", "fp16", "bf16"}, CLI::ignore_case))
      ->capture_default_str();
  app->add_flag("--no-shared-memory", args.no_shared_memory,
                "Reduce CPU gradients over Gloo's TCP ring even when every worker runs on this "
                "host (by default they go through shared memory on the training thread)");
}

} // namespace

Command add_train(CLI::App& parent) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* app = parent.add_subcommand(
      "train", "Train a built-in model as one worker of the cluster in TF_CONFIG (or alone)");
  add_data_flags(app, *args);
  add_recipe_flags(app, *args);
  add_performance_flags(app, *args);
  add_output_flags(app, *args);
  add_cluster_flags(app, *args);
  return {app, [args] {
            args->command = this_command();
            return run(*args);
          }};
}

} // namespace flotilla::tools
