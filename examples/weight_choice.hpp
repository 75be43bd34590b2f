// The weight format a program runs its model in (--weights), shared by generate and server: the
// flag's declaration, and the model file's weights loaded in that format.
#pragma once

#include <filesystem>
#include <kvdecode/io/load_model.hpp>
#include <kvdecode/kvdecode.hpp>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "cli.hpp"

namespace cli {

enum class WeightType { kStored, kF32, kBf16, kQ8_0, kQ4_0 };

/// --weights' values and their names.
inline const std::vector<std::pair<std::string, WeightType>>& weight_choices() {
  static const std::vector<std::pair<std::string, WeightType>> choices = {
      {"stored", WeightType::kStored},
      {"f32", WeightType::kF32},
      {"bf16", WeightType::kBf16},
      {"q8_0", WeightType::kQ8_0},
      {"q4_0", WeightType::kQ4_0}};
  return choices;
}

/// --weights (or the flag `names`), into `target` (default: as the file stores its matrices).
inline CLI::Option* weights_option(CLI::App& app, WeightType& target,
                                   const std::string& names = "--weights") {
  return choice(app, names, target, weight_choices(),
                "stored: as the file keeps its layer matrices (a GGUF file's q8_0, q4_0 or bf16 "
                "blocks as they are; f32 for f32/f16 GGUF files and llama2.c checkpoints); f32; "
                "bf16: weights rounded to bfloat16, half the bytes a decode step reads; q8_0 / "
                "q4_0: ggml's blocks of 32 weights (34 / 18 bytes), converted on load unless the "
                "file stores them so, integer dot products; arithmetic otherwise f32");
}

/// The weights in the format the model runs on.
using AnyWeights =
    std::variant<kvdecode::Weights<float>, kvdecode::Weights<kvdecode::bf16>,
                 kvdecode::Weights<kvdecode::Q8_0>, kvdecode::Weights<kvdecode::Q4_0>>;

/// A model of f32 activations on any of those weights.
using AnyModel =
    std::variant<kvdecode::Model<float>, kvdecode::Model<float, kvdecode::bf16>,
                 kvdecode::Model<float, kvdecode::Q8_0>, kvdecode::Model<float, kvdecode::Q4_0>>;

/// The model of `weights`, built in place in `model`.
inline void emplace_model(std::optional<AnyModel>& model, AnyWeights&& weights) {
  std::visit(
      [&]<class W>(kvdecode::Weights<W>& w) {
        model.emplace(std::in_place_type<kvdecode::Model<float, W>>, std::move(w));
      },
      weights);
}

/// The --weights value that keeps a file's stored format.
inline WeightType weight_type(kvdecode::WeightFormat f) {
  switch (f) {
    case kvdecode::WeightFormat::kBf16:
      return WeightType::kBf16;
    case kvdecode::WeightFormat::kQ8_0:
      return WeightType::kQ8_0;
    case kvdecode::WeightFormat::kQ4_0:
      return WeightType::kQ4_0;
    case kvdecode::WeightFormat::kF32:
      break;
  }
  return WeightType::kF32;
}

/// The --weights name of the format `weights` holds.
inline const char* weight_name(const AnyWeights& weights) {
  // AnyWeights' alternatives, in order.
  constexpr WeightType kHeld[] = {WeightType::kF32, WeightType::kBf16, WeightType::kQ8_0,
                                  WeightType::kQ4_0};
  static_assert(std::size(kHeld) == std::variant_size_v<AnyWeights>);
  for (const auto& [name, t] : weight_choices())
    if (t == kHeld[weights.index()]) return name.c_str();
  return "?";  // every alternative is named above
}

/// f32 weights (the demo model) in the format `t` (kStored: f32).
inline AnyWeights convert_to(kvdecode::Weights<float> w, WeightType t) {
  using namespace kvdecode;
  if (t == WeightType::kBf16) return convert_weights<bf16>(w);
  if (t == WeightType::kQ8_0) return quantize_weights<Q8_0>(w);
  if (t == WeightType::kQ4_0) return quantize_weights<Q4_0>(w);
  return w;
}

/// The model file's weights in the format `t` (kStored: the one stored_weights() reads from
/// the file), each tensor converted only when its stored type is not t's, and its vocabulary
/// (of either kind) when it holds one.
inline AnyWeights load_as(const std::filesystem::path& model, WeightType t,
                          std::optional<kvdecode::Vocabulary>& vocabulary) {
  using namespace kvdecode;
  if (t == WeightType::kStored) t = weight_type(stored_weights(model).format);
  const auto take = [&](auto loaded) -> AnyWeights {
    vocabulary = take_vocabulary(loaded);
    return std::move(loaded.weights);
  };
  if (t == WeightType::kBf16) return take(load_model<bf16>(model));
  if (t == WeightType::kQ8_0) return take(load_model<Q8_0>(model));
  if (t == WeightType::kQ4_0) return take(load_model<Q4_0>(model));
  return take(load_model<float>(model));
}

}  // namespace cli
