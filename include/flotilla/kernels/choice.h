// Which implementation runs an operation that flotilla has a kernel of its own for (Winograd's
// 3x3 convolution, BatchNorm+ReLU, the first layer's convolution+ReLU+max-pool, ReLU+max-pool,
// dropout, GELU+dropout, attention): flotilla's, or ATen's (oneDNN's, MKL's).
//
// Measured, as cuDNN's benchmark mode chooses: at an operation's first use at a given shape,
// type, layout and thread count, both candidates run forward and backward (forward only where
// no gradient is wanted) on inputs of that shape, a few times each, warm, and the faster one
// runs from then on. Which one wins depends on the CPU: on a CPU whose oneDNN multiplies
// bfloat16 on AMX tiles, ATen's convolutions beat flotilla's float32 Winograd products; on one
// without, they lose.
//
// The choices are kept on disk, in a file named after this CPU (model and flags) and this build
// of the program, under the cache directory (FLOTILLA_CACHE_DIR, or $XDG_CACHE_HOME/flotilla,
// or ~/.cache/flotilla; see set_cache_directory): a second run reads them and times nothing, so
// a rerun on the same machine makes the same choices. Workers on one host that share the
// directory take a lock on it while they measure, so the first one measures and the others read
// its choices: every replica on the host runs the same kernels. (Hosts of different CPU kinds
// may choose differently; the reduced gradient is the same on all, so the mirrored weights stay
// equal.) A file that is not one of these (damaged, another program's, another CPU's under this
// name) is ignored with a warning, never trusted and never overwritten.
//
// Mode::kFixed runs flotilla's kernel wherever it applies, as flotilla did before it measured:
// its results do not depend on the instruction set (AVX2 and AVX-512 agree to the bit), so a
// run is bit-reproducible across machines that run the same ATen kernels for the rest.
// Mode::kNone runs ATen's everywhere.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace flotilla::kernels {

enum class Mode { kMeasure, kFixed, kNone };

// "measure", "fixed" or "none"; ConfigError for anything else.
Mode parse_mode(const std::string& text);
std::string to_string(Mode mode);

// Process-wide, like the mixed-precision policy: set it before training. Default kMeasure.
void set_mode(Mode mode);
Mode mode();

// Where measured choices are kept. nullopt (the default): FLOTILLA_CACHE_DIR, else
// $XDG_CACHE_HOME/flotilla, else $HOME/.cache/flotilla, each with "kernels/" below it. An empty
// path keeps them in memory only (every process measures).
void set_cache_directory(std::optional<std::filesystem::path> directory);
// The directory in use ("" where none: no HOME, or set empty).
std::filesystem::path cache_directory();
// The file this CPU and build read and write ("" where none).
std::filesystem::path cache_file();

// One operation at one shape: what runs there and what the measurement found.
struct Decision {
  std::string op;    // "conv3x3", "batch_norm_relu", "dropout", ...
  std::string key;   // the shape, type and threads it holds for
  bool flotilla = false;
  // Milliseconds a run of each (forward and backward where trained), the faster of its runs;
  // 0 where not measured (Mode::kFixed, kNone, or only one candidate applies).
  double flotilla_ms = 0, aten_ms = 0;
  bool from_cache = false; // read from the cache file, not timed by this process
  // ATen's time over flotilla's: above 1 where flotilla's kernel is faster.
  double ratio() const { return flotilla_ms > 0 ? aten_ms / flotilla_ms : 0; }
};

// This process's decisions so far, in the order of their first use.
std::vector<Decision> decisions();
// Seconds this process spent timing candidates.
double seconds_measuring();

// The decisions so far in lines a person reads, one per kind of operation ("3x3 convolutions:
// flotilla's at 4 of 4 shapes, 1.21-3.57x ATen's"), after one on the mode and the cache.
std::vector<std::string> summary_lines();

// Forgets this process's decisions (the cache file stays): for tests and benchmarks that
// switch modes.
void reset_decisions();

} // namespace flotilla::kernels
