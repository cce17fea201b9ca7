#include "flotilla/train/losses.h"

#include <torch/nn/functional/loss.h>

#include <cmath>

#include "flotilla/error.h"

namespace flotilla::train {
namespace F = torch::nn::functional;

LossKind parse_loss(const std::string& name) {
  if (name == "sparse_categorical_crossentropy") return LossKind::kSparseCategoricalCrossentropy;
  if (name == "categorical_crossentropy") return LossKind::kCategoricalCrossentropy;
  if (name == "binary_crossentropy") return LossKind::kBinaryCrossentropy;
  if (name == "mse" || name == "mean_squared_error") return LossKind::kMeanSquaredError;
  throw ConfigError("loss \"" + name +
                    "\" is not available; use sparse_categorical_crossentropy, "
                    "categorical_crossentropy, binary_crossentropy or mean_squared_error");
}

std::string to_string(LossKind kind) {
  switch (kind) {
  case LossKind::kSparseCategoricalCrossentropy: return "sparse_categorical_crossentropy";
  case LossKind::kCategoricalCrossentropy: return "categorical_crossentropy";
  case LossKind::kBinaryCrossentropy: return "binary_crossentropy";
  case LossKind::kMeanSquaredError: return "mean_squared_error";
  }
  return "unknown";
}

void validate(const LossOptions& options) {
  if (!(options.label_smoothing >= 0 && options.label_smoothing <= 1)) {
    throw ConfigError("label_smoothing must be in [0, 1]; saw " +
                      std::to_string(options.label_smoothing));
  }
  for (std::size_t o = 0; o < options.loss_weights.size(); ++o) {
    const double w = options.loss_weights[o];
    if (!(w >= 0) || std::isinf(w)) {
      throw ConfigError("loss_weights[" + std::to_string(o) + "] must be a finite number at least "
                        "0; saw " + std::to_string(w));
    }
  }
  if (options.label_smoothing > 0 && options.kind == LossKind::kMeanSquaredError) {
    throw ConfigError("label_smoothing applies to cross-entropy losses, not mean_squared_error; "
                      "set it to 0");
  }
}

namespace {

// Losses are computed in float32 even under a mixed policy (Keras keeps the loss in float32).
torch::Tensor at_least_float32(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat64 ? t : t.to(torch::kFloat32);
}

void require_rank(const torch::Tensor& outputs, std::int64_t dims, const char* loss,
                  const char* shape) {
  if (outputs.dim() != dims) {
    throw DataError(std::string(loss) + " expects outputs of shape " + shape + "; saw " +
                    c10::str(outputs.sizes()));
  }
}

void require_same_shape(const torch::Tensor& outputs, const torch::Tensor& labels,
                        const char* loss) {
  if (outputs.sizes() != labels.sizes()) {
    throw DataError(std::string(loss) + " expects labels shaped like the outputs " +
                    c10::str(outputs.sizes()) + "; saw labels " + c10::str(labels.sizes()));
  }
}

// Per-example mean over every axis but the first.
torch::Tensor mean_per_example(const torch::Tensor& t) {
  return t.dim() <= 1 ? t : t.flatten(1).mean(1);
}

// Labels shaped like the outputs; [N] labels also fit outputs [N, 1].
torch::Tensor labels_like(const torch::Tensor& outputs, const torch::Tensor& labels,
                          const char* what) {
  if (labels.sizes() == outputs.sizes()) return labels;
  if (outputs.dim() == 2 && outputs.size(1) == 1 && labels.dim() == 1) return labels.unsqueeze(1);
  require_same_shape(outputs, labels, what);
  return labels;
}

// A user's loss for `n` examples, per example.
torch::Tensor per_example_of(const torch::Tensor& raw, std::int64_t n, const char* what) {
  const torch::Tensor loss = at_least_float32(raw);
  if (loss.dim() == 0) return loss.expand({n}); // the slice's mean, once per example
  if (loss.dim() != 1 || loss.size(0) != n) {
    throw ConfigError(std::string(what) + " gave a tensor of shape " + c10::str(loss.sizes()) +
                      " for " + std::to_string(n) + " examples; give one value per example ([" +
                      std::to_string(n) + "]) or a scalar (their mean)");
  }
  return loss;
}

std::int64_t rows_of(const torch::Tensor& t) {
  return t.dim() > 0 ? t.size(0) : 1;
}

} // namespace

torch::Tensor per_example_loss(const LossOptions& options, const Tensors& outputs,
                               const Tensors& labels) {
  if (options.custom_outputs) {
    return per_example_of(options.custom_outputs(outputs, labels), rows_of(outputs.at(0)),
                          "the custom loss of the outputs");
  }
  torch::Tensor total;
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    torch::Tensor loss = per_example_loss(options, outputs[o], labels.at(o));
    if (!options.loss_weights.empty()) loss = loss * options.loss_weights.at(o);
    total = total.defined() ? total + loss : loss;
  }
  return total;
}

torch::Tensor per_example_loss(const LossOptions& options, const torch::Tensor& raw_outputs,
                               const torch::Tensor& labels) {
  if (options.custom) {
    return per_example_of(options.custom(raw_outputs, labels), rows_of(raw_outputs),
                          "the custom loss");
  }
  const torch::Tensor outputs = at_least_float32(raw_outputs);
  const double s = options.label_smoothing;
  switch (options.kind) {
  case LossKind::kSparseCategoricalCrossentropy: {
    require_rank(outputs, 2, "sparse_categorical_crossentropy", "[batch, classes]");
    if (labels.dim() != 1 || labels.size(0) != outputs.size(0)) {
      throw DataError("sparse_categorical_crossentropy expects integer labels of shape [" +
                      std::to_string(outputs.size(0)) + "]; saw " + c10::str(labels.sizes()));
    }
    const torch::Tensor log_probs =
        options.from_logits ? torch::log_softmax(outputs, 1) : outputs.clamp_min(1e-7).log();
    return F::nll_loss(log_probs, labels.to(torch::kLong),
                       F::NLLLossFuncOptions().reduction(torch::kNone)) *
               (1 - s) -
           (s > 0 ? log_probs.mean(1) * s : torch::zeros_like(log_probs.select(1, 0)));
  }
  case LossKind::kCategoricalCrossentropy: {
    require_rank(outputs, 2, "categorical_crossentropy", "[batch, classes]");
    require_same_shape(outputs, labels, "categorical_crossentropy");
    torch::Tensor targets = labels.to(outputs.dtype());
    if (s > 0) targets = targets * (1 - s) + s / static_cast<double>(outputs.size(1));
    const torch::Tensor log_probs =
        options.from_logits ? torch::log_softmax(outputs, 1) : outputs.clamp_min(1e-7).log();
    return -(targets * log_probs).sum(1);
  }
  case LossKind::kBinaryCrossentropy: {
    torch::Tensor targets = labels_like(outputs, labels, "binary_crossentropy").to(outputs.dtype());
    if (s > 0) targets = targets * (1 - s) + s / 2;
    const torch::Tensor per_element =
        options.from_logits
            ? F::binary_cross_entropy_with_logits(
                  outputs, targets, F::BinaryCrossEntropyWithLogitsFuncOptions().reduction(
                                        torch::kNone))
            : F::binary_cross_entropy(outputs.clamp(1e-7, 1 - 1e-7), targets,
                                      F::BinaryCrossEntropyFuncOptions().reduction(torch::kNone));
    return mean_per_example(per_element);
  }
  case LossKind::kMeanSquaredError: {
    const torch::Tensor targets = labels_like(outputs, labels, "mean_squared_error").to(outputs.dtype());
    return mean_per_example((outputs - targets).square());
  }
  }
  throw ConfigError("unknown loss");
}

Metric make_metric(const std::string& name, const LossOptions& loss) {
  using Fn = decltype(Metric::per_example);
  const Fn sparse_accuracy = [](const torch::Tensor& out, const torch::Tensor& labels) {
    return out.argmax(1).eq(labels.to(torch::kLong)).to(torch::kFloat32);
  };
  const Fn categorical_accuracy = [](const torch::Tensor& out, const torch::Tensor& labels) {
    return out.argmax(1).eq(labels.argmax(1)).to(torch::kFloat32);
  };
  // Logits are thresholded at 0, probabilities at 0.5: the same decision.
  const double threshold = loss.from_logits ? 0.0 : 0.5;
  const Fn binary_accuracy = [threshold](const torch::Tensor& out, const torch::Tensor& labels) {
    const torch::Tensor targets = labels_like(out, labels, "binary_accuracy");
    return mean_per_example(out.gt(threshold).eq(targets.gt(0.5)).to(torch::kFloat32));
  };
  if (name == "accuracy" || name == "acc") {
    switch (loss.kind) {
    case LossKind::kCategoricalCrossentropy: return {"accuracy", categorical_accuracy};
    case LossKind::kBinaryCrossentropy: return {"accuracy", binary_accuracy};
    case LossKind::kMeanSquaredError:
      throw ConfigError("metric \"accuracy\" is undefined for mean_squared_error; use \"mae\" or "
                        "\"mse\"");
    default: return {"accuracy", sparse_accuracy};
    }
  }
  if (name == "sparse_categorical_accuracy") return {name, sparse_accuracy};
  if (name == "categorical_accuracy") return {name, categorical_accuracy};
  if (name == "binary_accuracy") return {name, binary_accuracy};
  const std::string top_k = "sparse_top_k_categorical_accuracy";
  if (name.rfind(top_k, 0) == 0) {
    std::int64_t k = 5;
    if (name.size() > top_k.size()) {
      const std::string suffix = name.substr(top_k.size());
      try {
        std::size_t used = 0;
        if (suffix[0] != '@') throw std::invalid_argument(suffix);
        k = std::stoll(suffix.substr(1), &used);
        if (used + 1 != suffix.size() || k < 1) throw std::invalid_argument(suffix);
      } catch (const std::exception&) {
        throw ConfigError("metric \"" + name + "\": write k as " + top_k + "@3 (k >= 1)");
      }
    }
    return {name, [k](const torch::Tensor& out, const torch::Tensor& labels) {
              const torch::Tensor top = std::get<1>(out.topk(std::min<std::int64_t>(k, out.size(1)), 1));
              return top.eq(labels.to(torch::kLong).unsqueeze(1)).any(1).to(torch::kFloat32);
            }};
  }
  if (name == "mse" || name == "mean_squared_error") {
    return {name, [](const torch::Tensor& out, const torch::Tensor& labels) {
              return mean_per_example((out.to(torch::kFloat32) -
                                       labels_like(out, labels, "mse").to(torch::kFloat32))
                                          .square());
            }};
  }
  if (name == "mae" || name == "mean_absolute_error") {
    return {name, [](const torch::Tensor& out, const torch::Tensor& labels) {
              return mean_per_example((out.to(torch::kFloat32) -
                                       labels_like(out, labels, "mae").to(torch::kFloat32))
                                          .abs());
            }};
  }
  throw ConfigError("metric \"" + name +
                    "\" is not available; use accuracy, sparse_categorical_accuracy, "
                    "categorical_accuracy, binary_accuracy, sparse_top_k_categorical_accuracy[@k], "
                    "mse or mae, or pass a train::Metric of your own");
}

} // namespace flotilla::train
