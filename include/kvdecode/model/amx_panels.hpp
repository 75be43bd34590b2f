// AmxPanels: a bf16 model's layer matrices re-laid once, when the model is built, in the panel
// order the AMX tiles read (detail/gemm_amx.hpp, pack_weights_amx), so that prefill loads its B
// tiles straight from memory instead of re-laying every panel on every call. A second copy:
// decode's GEMV and the few-token kernels keep reading the row-major matrices of Weights.
#pragma once

#include <cstddef>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemm_amx.hpp"
#include "kvdecode/model/weights.hpp"

namespace kvdecode {

/// One layer's projection matrices re-laid, each [amx_packed_size(out, in)] bf16 (empty when
/// in < 16, where the tiles do not run).
struct AmxLayerPanels {
  AlignedBuffer<bf16> wq;  // [dim][dim]           as panels of 32 rows
  AlignedBuffer<bf16> wk;  // [kv_dim][dim]
  AlignedBuffer<bf16> wv;  // [kv_dim][dim]
  AlignedBuffer<bf16> wo;  // [dim][dim]
  AlignedBuffer<bf16> w1;  // [hidden_dim][dim]
  AlignedBuffer<bf16> w2;  // [dim][hidden_dim]
  AlignedBuffer<bf16> w3;  // [hidden_dim][dim]
};

class AmxPanels {
 public:
  /// Builds the panels where prefill would run on AMX tiles: the CPU and OS allow them, the
  /// avx512bf16 set is there and AMX is on (KVDECODE_AMX, force_amx) at this point; else holds
  /// nothing, and prefill re-lays each panel per call if AMX is turned on later.
  static bool wanted() {
    return KVDECODE_AMX_KERNELS && cpu_supports_amx() && cpu_supports(KernelSet::kAvx512Bf16) &&
           amx_enabled();
  }

  AmxPanels() = default;
  /// Every layer matrix of w re-laid; the classifier stays as it is (prefill runs it for one
  /// token, a GEMV, unless every position's logits are asked for).
  explicit AmxPanels(const Weights<bf16>& w) {
    const auto dim = static_cast<std::size_t>(w.config.dim);
    const auto hidden = static_cast<std::size_t>(w.config.hidden_dim);
    const auto kv_dim = static_cast<std::size_t>(w.config.kv_dim());
    const auto relay = [](const AlignedBuffer<bf16>& m, std::size_t out, std::size_t in) {
      if (in < 16) return AlignedBuffer<bf16>();
      AlignedBuffer<bf16> packed(detail::amx_packed_size(out, in));
      detail::pack_weights_amx(packed.data(), m.data(), out, in);
      return packed;
    };
    layers_.reserve(w.layers.size());
    for (const LayerWeights<bf16>& lw : w.layers) {
      AmxLayerPanels p;
      p.wq = relay(lw.wq, dim, dim);
      p.wk = relay(lw.wk, kv_dim, dim);
      p.wv = relay(lw.wv, kv_dim, dim);
      p.wo = relay(lw.wo, dim, dim);
      p.w1 = relay(lw.w1, hidden, dim);
      p.w2 = relay(lw.w2, dim, hidden);
      p.w3 = relay(lw.w3, hidden, dim);
      layers_.push_back(std::move(p));
    }
  }

  /// Matrix m of layer l re-laid, or nullptr where none was built.
  const bf16* get(std::size_t l, AlignedBuffer<bf16> AmxLayerPanels::*m) const {
    if (l >= layers_.size() || (layers_[l].*m).empty()) return nullptr;
    return (layers_[l].*m).data();
  }

  /// Bytes held: the memory the panels add to the weights (0 when none were built).
  std::size_t bytes() const {
    std::size_t total = 0;
    for (const AmxLayerPanels& p : layers_)
      total += p.wq.bytes() + p.wk.bytes() + p.wv.bytes() + p.wo.bytes() + p.w1.bytes() +
               p.w2.bytes() + p.w3.bytes();
    return total;
  }

 private:
  std::vector<AmxLayerPanels> layers_;  // [n_layers], empty when not built
};

}  // namespace kvdecode
