// The library's templates most tests use, instantiated once in test_instances.cpp (linked into
// every test) instead of in each test's translation unit: a header-only library otherwise
// compiles the model's whole pass again in every test. Only build time changes. A test built
// with other code-generation flags (attention_products_test, built without AVX) defines
// KVDECODE_TEST_OWN_INSTANCES and instantiates its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"

// E is `extern` (a declaration: use the shared instance) or empty (the definition).
#define KVDECODE_TEST_MODEL_RUN(E, T, W, S)                                             \
  E template std::span<const T> kvdecode::Model<T, W>::run<S>(                          \
      std::span<const std::int32_t>, std::span<const std::size_t>, std::span<S* const>, \
      Activations<T>&, std::span<T>, Phase, bool) const;

#define KVDECODE_TEST_INSTANCES(E)                                                          \
  E template kvdecode::Weights<float>::Weights(const ModelConfig&);                         \
  E template kvdecode::Weights<double>::Weights(const ModelConfig&);                        \
  E template kvdecode::Weights<kvdecode::bf16>::Weights(const ModelConfig&);                \
  E template kvdecode::Weights<kvdecode::Q8_0>::Weights(const ModelConfig&);                \
  E template kvdecode::Weights<kvdecode::Q4_0>::Weights(const ModelConfig&);                \
  E template struct kvdecode::Activations<float>;                                           \
  E template struct kvdecode::Activations<double>;                                          \
  E template struct kvdecode::AttentionScratch<float>;                                      \
  E template class kvdecode::ContiguousStore<float>;                                        \
  E template class kvdecode::ContiguousStore<double>;                                       \
  E template class kvdecode::BlockPool<float>;                                              \
  E template class kvdecode::BlockPool<double>;                                             \
  E template class kvdecode::PagedStore<float>;                                             \
  E template class kvdecode::PagedStore<double>;                                            \
  E template class kvdecode::Int8Store<float>;                                              \
  E template class kvdecode::Int8Store<double>;                                             \
  E template class kvdecode::LowBitStore<float, 4>;                                         \
  E template class kvdecode::LowBitStore<float, 2>;                                         \
  E template class kvdecode::WindowStore<float>;                                            \
  E template class kvdecode::Model<float>;                                                  \
  E template class kvdecode::Model<double>;                                                 \
  E template class kvdecode::Model<float, kvdecode::bf16>;                                  \
  E template class kvdecode::Model<float, kvdecode::Q8_0>;                                  \
  E template class kvdecode::Model<float, kvdecode::Q4_0>;                                  \
  E template class kvdecode::Engine<double>;                                                \
  E template kvdecode::Weights<float> kvdecode::random_weights<float>(const ModelConfig&,   \
                                                                      std::uint64_t);       \
  E template kvdecode::Weights<double> kvdecode::random_weights<double>(const ModelConfig&, \
                                                                        std::uint64_t);     \
  E template std::vector<float> kvdecode::forward_reference<float>(                         \
      const Weights<float>&, std::span<const std::int32_t>, std::size_t);                   \
  E template std::vector<double> kvdecode::forward_reference<double>(                       \
      const Weights<double>&, std::span<const std::int32_t>, std::size_t);                  \
  KVDECODE_TEST_MODEL_RUN(E, float, float, kvdecode::ContiguousStore<float>)                \
  KVDECODE_TEST_MODEL_RUN(E, double, double, kvdecode::ContiguousStore<double>)             \
  KVDECODE_TEST_MODEL_RUN(E, float, float, kvdecode::PagedStore<float>)                     \
  KVDECODE_TEST_MODEL_RUN(E, double, double, kvdecode::PagedStore<double>)                  \
  KVDECODE_TEST_MODEL_RUN(E, float, float, kvdecode::WindowStore<float>)                    \
  KVDECODE_TEST_MODEL_RUN(E, float, float, kvdecode::Int8Store<float>)                      \
  KVDECODE_TEST_MODEL_RUN(E, float, float, kvdecode::Q4Store<float>)                        \
  KVDECODE_TEST_MODEL_RUN(E, double, double, kvdecode::Int8Store<double>)                   \
  KVDECODE_TEST_MODEL_RUN(E, float, kvdecode::bf16, kvdecode::ContiguousStore<float>)       \
  KVDECODE_TEST_MODEL_RUN(E, float, kvdecode::Q8_0, kvdecode::ContiguousStore<float>)       \
  KVDECODE_TEST_MODEL_RUN(E, float, kvdecode::Q4_0, kvdecode::ContiguousStore<float>)

#ifndef KVDECODE_TEST_OWN_INSTANCES
KVDECODE_TEST_INSTANCES(extern)
#endif
