// ModelConfig::validate(): every rule named in its message, with the offending values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "kvdecode/model/model_config.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

struct BadConfig {
  std::string name;
  std::function<void(ModelConfig&)> mutate;
  std::string message;
};

TEST(ModelConfigTest, ValidConfigPassesAndDerivesSizes) {
  const ModelConfig c = testing_util::small_config(6, 2);
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.head_size(), 16);
  EXPECT_EQ(c.kv_dim(), 32);
  EXPECT_EQ(c.kv_mul(), 3);
}

TEST(ModelConfigTest, EachBrokenRuleIsNamed) {
  const std::vector<BadConfig> cases = {
      {"zero dim", [](ModelConfig& c) { c.dim = 0; }, "dim must be positive, got 0"},
      {"negative hidden", [](ModelConfig& c) { c.hidden_dim = -5; },
       "hidden_dim must be positive, got -5"},
      {"zero layers", [](ModelConfig& c) { c.n_layers = 0; }, "n_layers must be positive, got 0"},
      {"zero heads", [](ModelConfig& c) { c.n_heads = 0; }, "n_heads must be positive, got 0"},
      {"zero kv heads", [](ModelConfig& c) { c.n_kv_heads = 0; },
       "n_kv_heads must be positive, got 0"},
      {"zero vocab", [](ModelConfig& c) { c.vocab_size = 0; },
       "vocab_size must be positive, got 0"},
      {"negative seq", [](ModelConfig& c) { c.seq_len = -1; }, "seq_len must be positive, got -1"},
      {"dim not divisible", [](ModelConfig& c) { c.dim = 66; },
       "dim (66) must be divisible by n_heads (4)"},
      {"heads not multiple", [](ModelConfig& c) { c.n_kv_heads = 3; },
       "n_heads (4) must be a multiple of n_kv_heads (3)"},
      {"more kv than q heads", [](ModelConfig& c) { c.n_kv_heads = 8; },
       "n_heads (4) must be a multiple of n_kv_heads (8)"},
      {"odd head size", [](ModelConfig& c) { c.dim = 36; },
       "head_size = dim / n_heads = 36 / 4 = 9 must be even"},
      {"theta", [](ModelConfig& c) { c.rope_theta = 0.5; },
       "rope_theta (0.5) must be greater than 1"},
      {"eps", [](ModelConfig& c) { c.norm_eps = 0; }, "norm_eps (0) must lie in (0, 1)"},
      {"huge vocab", [](ModelConfig& c) { c.vocab_size = std::int64_t{1} << 33; },
       "vocab_size (8589934592) must fit in int32"},
      {"huge dim",
       [](ModelConfig& c) {
         c.dim = std::int64_t{1} << 30;
         c.n_heads = 1;
         c.n_kv_heads = 1;
       },
       "dim (1073741824) exceeds the supported maximum"},
  };
  for (const auto& bad : cases) {
    ModelConfig c = testing_util::small_config(4, 2);
    bad.mutate(c);
    try {
      c.validate();
      ADD_FAILURE() << bad.name << ": no error";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(bad.message)) << bad.name;
      EXPECT_THAT(e.what(), ::testing::StartsWith("kvdecode: ModelConfig: ")) << bad.name;
    }
  }
}

TEST(ModelConfigTest, ConstructorsValidate) {
  ModelConfig c = testing_util::small_config(4, 2);
  c.n_kv_heads = 3;
  EXPECT_THROW(Weights<float>{c}, Error);
  EXPECT_THROW(ContiguousStore<float>{c}, Error);
  EXPECT_THROW(Activations<float>{c}, Error);
}

}  // namespace
}  // namespace kvdecode
