// Engine<T, W>: continuous batching on a paged KV pool. Requests arrive at any time from any
// thread; each step decodes every running sequence in one batched pass and spends the rest of a
// token budget on chunked prefill of waiting ones (vLLM's chunked-prefill scheduling), admitting
// requests while the pool has blocks and preempting (by recomputation) when it runs out. With a
// prefix directory, a PrefixTier keeps the pool's evicted blocks on disk for later processes.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "kvdecode/error.hpp"
#include "kvdecode/generation/sampler.hpp"
#include "kvdecode/model/activations.hpp"
#include "kvdecode/model/model.hpp"
#include "kvdecode/serving/engine_metrics.hpp"
#include "kvdecode/serving/pass_cost_model.hpp"
#include "kvdecode/serving/prefix_tier.hpp"
#include "kvdecode/serving/request.hpp"
#include "kvdecode/serving/sub_pass_planner.hpp"
#include "kvdecode/store/block_pool.hpp"
#include "kvdecode/store/paged_store.hpp"
#include "kvdecode/thread_pool.hpp"

namespace kvdecode {

/// What an Engine is built with.
struct EngineOptions {
  std::size_t n_blocks = 256;   ///< blocks of the pool, all K/V memory
  std::size_t block_size = 16;  ///< positions per block
  /// Sequences admitted at once: the rows of a batched decode step (Activations' max_batch).
  std::size_t max_running = 16;
  /// Tokens one step runs: one per decoding sequence, the rest prefill chunks. At least
  /// max_running; a prompt longer than what is left waits for the next steps.
  std::size_t step_tokens = 256;
  bool prefix_cache = true;           ///< keep full blocks for later requests with the same prefix
  std::size_t capacity = 0;           ///< positions of one sequence; 0 means the model's seq_len
  ThreadPool* thread_pool = nullptr;  ///< the threads of every step (not owned); nullptr: none
  /// A directory of block files behind the prefix cache (serving/prefix_tier.hpp): blocks the
  /// pool evicts are written there, a prompt block missing in memory is looked for there, and
  /// the destructor writes every cached block, so a new engine on the directory reuses prefixes
  /// an earlier one computed. Empty: no tier. Needs prefix_cache; construction then hashes
  /// every weight once (the files are only valid for these exact weights).
  std::filesystem::path prefix_dir{};
  /// The most bytes of block files kept in prefix_dir, least recently used removed first; at
  /// least one block file (PrefixTier<T>::file_bytes_for).
  std::uint64_t prefix_max_bytes = std::uint64_t{1} << 30;
  /// Split a step into sub-passes so that prompts completing early publish their first token
  /// early (SubPassPlanner); false: one pass per step.
  bool sub_passes = true;
  /// The pass cost the sub-passes are planned with; empty: learned from the step's own passes
  /// (PassCostModel), one pass per step until it has an estimate.
  std::optional<PassCost> pass_cost{};
};

/// A serving engine over one Model and one BlockPool that it owns.
///
/// Threads: submit(), metrics() and the RequestStream handles may be used from any thread;
/// step() and run() from one thread only (the step thread), which alone touches the pool.
///
/// A step (step()):
///  1. takes new submissions and drops cancelled requests (their blocks go back to the pool);
///  2. plans one token for every decoding sequence, oldest first; when the pool cannot give a
///     sequence its next block, the newest running sequence is preempted: its blocks are
///     released (full ones stay in the prefix cache) and it goes back to the front of the queue
///     with its prompt and every token generated so far, to be recomputed on readmission;
///  3. spends the rest of step_tokens on the next chunk of sequences still prefilling, then on
///     admitting waiting requests in arrival order while a slot, the budget and blocks for
///     their whole remaining prompt are left; an admitted request starts from the longest
///     cached prefix of its tokens (PagedStore::open), so a conversation's next turn and a
///     shared system prompt are computed once;
///  4. runs what is planned in one or more Model::prefill_batch passes (each reads every weight
///     once): the decoding sequences and the prompts that complete this step go first, shortest
///     first, then the chunks of prompts that do not; SubPassPlanner splits that order where the
///     earlier first tokens are worth another pass's fixed cost (PassCost, measured from the
///     engine's own passes unless given). After each pass, the next token of every sequence in
///     it whose tokens are all computed is sampled (each sequence has its own Sampler, so the
///     draws are shared out on the step's threads) and pushed to its stream at once.
/// A sequence's sampler lives as long as its request and only advances when it samples, so a
/// preempted request produces what it would have produced alone.
///
/// Prefix tier (options.prefix_dir): the engine owns a PrefixTier attached to its pool. The pool
/// itself asks it when a prompt block misses in memory (BlockPool::match_prefix) and hands it
/// every cached block it evicts; the engine only counts what came from disk and, when it is
/// destroyed (or on flush_prefix_tier()), offers it every block still cached in memory.
///
/// No allocation in a step that admits nothing: the batch lists and the planner are reserved for
/// max_running and step_tokens, a stream's token list for its max_tokens. (A tier allocates when a
/// step evicts a cached block, to write its file.)
template <class T, class W = T>
class Engine {
 public:
  using Clock = std::chrono::steady_clock;

  /// Throws Error for options the model or the pool refuse (naming the option), and for a
  /// prefix_dir that cannot be created or written, before the pool's memory is taken.
  Engine(const Model<T, W>& model, const EngineOptions& options)
      : model_(model),
        options_(checked(options, model.config())),
        tier_(make_tier(model, options_)),
        pool_(
            model.config(), options_.n_blocks, options_.block_size,
            BlockPoolOptions{.capacity = options_.capacity, .prefix_cache = options_.prefix_cache}),
        act_(model.config(), {.max_chunk = options_.step_tokens,
                              .max_batch = options_.max_running,
                              .thread_pool = options_.thread_pool}),
        wake_(std::make_shared<detail::WakeSignal>()),
        planner_(options_.max_running) {
    running_.reserve(options_.max_running);
    batch_.reserve(options_.max_running);
    sampling_.reserve(options_.max_running);
    stores_.reserve(options_.max_running);
    lengths_.reserve(options_.max_running);
    prompt_rows_.reserve(options_.max_running);
    batch_tokens_.reserve(options_.step_tokens);
    // Attached last, so that a throw above leaves no tier pointing to a destroyed pool.
    if (tier_) tier_->attach(pool_);
    publish();  // metrics() shows the pool and the tier's files before the first step
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  /// Requests still queued or running end with kCancelled, so no reader waits forever; then
  /// every cached block goes to the prefix tier (flush_prefix_tier). The step loop must have
  /// stopped.
  ~Engine() {
    take_incoming();
    for (auto& s : running_) end(*s, FinishReason::kCancelled);
    for (auto& s : waiting_) end(*s, FinishReason::kCancelled);
    if (tier_) {
      pool_.spill_cached();
      tier_->detach();  // the tier is declared before the pool: detach while the pool lives
    }
  }

  const EngineOptions& options() const { return options_; }

  /// Queues a request and returns its handle; thread-safe. Throws Error, changing nothing, for
  /// an empty prompt, a token or stop token outside the vocabulary, max_tokens 0 or more than
  /// the context leaves after the prompt, a request whose prompt and tokens need more blocks
  /// than the whole pool, and sampling options the Sampler refuses.
  std::shared_ptr<RequestStream> submit(RequestOptions request) {
    const ModelConfig& cfg = model_.config();
    const std::size_t p = request.prompt.size();
    const std::size_t context = pool_.capacity();
    KVDECODE_CHECK(p > 0, "Engine::submit: the prompt has no tokens");
    for (std::size_t i = 0; i < p; ++i)
      KVDECODE_CHECK(request.prompt[i] >= 0 && request.prompt[i] < cfg.vocab_size,
                     "Engine::submit: prompt token ", request.prompt[i], " at position ", i,
                     " is outside the vocabulary [0, ", cfg.vocab_size, ")");
    for (const std::int32_t t : request.stop_tokens)
      KVDECODE_CHECK(t >= 0 && t < cfg.vocab_size, "Engine::submit: stop token ", t,
                     " is outside the vocabulary [0, ", cfg.vocab_size, ")");
    KVDECODE_CHECK(request.max_tokens > 0, "Engine::submit: max_tokens is 0, expected at least 1");
    KVDECODE_CHECK(p < context && request.max_tokens <= context - p, "Engine::submit: ", p,
                   " prompt tokens + max_tokens ", request.max_tokens, " exceed the context of ",
                   context, " positions");
    // The last generated token is never fed back: p + max_tokens - 1 positions at most.
    const std::size_t bs = pool_.block_size();
    const std::size_t blocks = (p + request.max_tokens - 1 + bs - 1) / bs;
    KVDECODE_CHECK(blocks <= pool_.n_blocks(), "Engine::submit: ", p, " prompt tokens + ",
                   request.max_tokens, " generated need ", blocks, " blocks of ", bs,
                   " positions, but the whole pool has ", pool_.n_blocks());
    auto seq = std::make_unique<Sequence>(cfg.vocab_size, request.sampling);  // checks sampling
    seq->tokens.reserve(p + request.max_tokens);
    seq->tokens.assign(request.prompt.begin(), request.prompt.end());
    seq->prompt_size = p;
    seq->max_tokens = request.max_tokens;
    seq->stop_tokens = std::move(request.stop_tokens);
    seq->on_token = std::move(request.on_token);
    seq->usage.prompt_tokens = p;
    seq->submitted = Clock::now();
    std::shared_ptr<RequestStream> stream;
    {
      std::lock_guard lock(incoming_mutex_);
      stream = std::make_shared<RequestStream>(++next_id_, request.max_tokens, wake_, readers_);
      seq->stream = stream;
      incoming_.push_back(std::move(seq));
      ++submitted_;
    }
    wake_->notify();
    return stream;
  }

  /// One scheduling step (see the class comment). Returns whether requests remain (queued or
  /// running). Step thread only.
  bool step() {
    take_incoming();
    drop_cancelled();
    plan_batch();
    if (!batch_.empty()) run_batch();
    ++m_.steps;
    publish();
    return !running_.empty() || !waiting_.empty();
  }

  /// Steps while there is work, sleeps while there is none (a submission or a cancellation
  /// wakes it), until `stop` is requested. Step thread only.
  void run(std::stop_token stop) {
    while (!stop.stop_requested()) {
      if (step()) continue;
      std::unique_lock lock(wake_->mutex);
      wake_->cv.wait(lock, stop, [&] { return wake_->pending; });
      wake_->pending = false;
    }
  }

  /// A snapshot of the counters and of the state after the latest step; thread-safe.
  EngineMetrics metrics() const {
    EngineMetrics m;
    {
      std::lock_guard lock(published_mutex_);
      m = published_;
    }
    std::lock_guard lock(incoming_mutex_);
    m.submitted = submitted_;
    m.queued += incoming_.size();
    return m;
  }

  /// The pool; step thread only (tests inspect its blocks between steps).
  const BlockPool<T>& pool() const { return pool_; }

  /// Writes every block cached in memory that the prefix tier has no file of yet (the
  /// destructor does the same) and publishes the metrics; returns the blocks offered, 0 without
  /// a tier. Step thread only, or while the step loop is stopped.
  std::size_t flush_prefix_tier() {
    const std::size_t n = pool_.spill_cached();
    publish();
    return n;
  }
  /// The prefix tier, nullptr without prefix_dir; step thread only.
  const PrefixTier<T>* prefix_tier() const { return tier_.get(); }

 private:
  struct Sequence {
    Sequence(std::int64_t vocab_size, const SamplerOptions& sampling)
        : sampler(vocab_size, sampling) {}
    std::shared_ptr<RequestStream> stream;
    std::vector<std::int32_t> tokens;  // [≤ prompt + max_tokens] the prompt, then generated
    std::size_t prompt_size = 0;
    std::size_t max_tokens = 0;
    std::vector<std::int32_t> stop_tokens;
    std::function<void(std::int32_t)> on_token;
    Sampler sampler;
    PagedStore<T> store;  // empty while queued
    // tokens.size() at the latest admission: rows below it are prompt (or recomputed) rows.
    std::size_t target = 0;
    bool admitted_before = false;
    bool planned = false;       // in the current step's batch
    std::size_t rows = 0;       // tokens it runs this step, when planned
    std::size_t plan_rank = 0;  // its place in the step's planning order
    bool done = false;
    RequestUsage usage;
    Clock::time_point submitted, last_token;
    std::size_t generated() const { return tokens.size() - prompt_size; }
  };

  static EngineOptions checked(EngineOptions o, const ModelConfig& cfg) {
    if (o.capacity == 0) o.capacity = static_cast<std::size_t>(cfg.seq_len);
    KVDECODE_CHECK(o.capacity <= static_cast<std::size_t>(cfg.seq_len), "Engine: capacity ",
                   o.capacity, " exceeds the model's seq_len ", cfg.seq_len);
    KVDECODE_CHECK(o.max_running >= 1, "Engine: max_running must be at least 1");
    KVDECODE_CHECK(o.step_tokens >= o.max_running, "Engine: step_tokens ", o.step_tokens,
                   " must be at least max_running ", o.max_running,
                   " (one token per decoding sequence)");
    if (o.pass_cost) {
      KVDECODE_CHECK(std::isfinite(o.pass_cost->fixed_ms) && o.pass_cost->fixed_ms >= 0 &&
                         std::isfinite(o.pass_cost->token_ms) && o.pass_cost->token_ms >= 0,
                     "Engine: pass_cost must be finite and >= 0, got fixed_ms ",
                     o.pass_cost->fixed_ms, " and token_ms ", o.pass_cost->token_ms);
    }
    if (!o.prefix_dir.empty()) {
      KVDECODE_CHECK(o.prefix_cache, "Engine: prefix_dir '", o.prefix_dir.string(),
                     "' needs prefix_cache");
      const std::size_t file = PrefixTier<T>::file_bytes_for(
          static_cast<std::size_t>(cfg.n_layers), static_cast<std::size_t>(cfg.n_kv_heads),
          static_cast<std::size_t>(cfg.head_size()), o.block_size);
      KVDECODE_CHECK(o.prefix_max_bytes >= file, "Engine: prefix_max_bytes ", o.prefix_max_bytes,
                     " is smaller than one block file (", file, " bytes at block_size ",
                     o.block_size, ")");
    }
    return o;
  }

  /// The tier of o.prefix_dir (created and checked for writing), not yet attached; or none.
  static std::unique_ptr<PrefixTier<T>> make_tier(const Model<T, W>& model,
                                                  const EngineOptions& o) {
    if (o.prefix_dir.empty()) return nullptr;
    return std::make_unique<PrefixTier<T>>(
        model_fingerprint(model),
        PrefixTierOptions{.directory = o.prefix_dir, .max_bytes = o.prefix_max_bytes});
  }

  static double ms_between(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  }

  // ---------------------------------------------------------------------------------------------
  // Queue and cancellation.

  void take_incoming() {
    std::lock_guard lock(incoming_mutex_);
    for (auto& s : incoming_) waiting_.push_back(std::move(s));
    incoming_.clear();
  }

  void drop_cancelled() {
    const auto drop = [&](Sequence& s) {
      if (!s.stream->cancel_requested()) return;
      end(s, s.stream->stop_requested() ? FinishReason::kStopString : FinishReason::kCancelled);
    };
    for (auto& s : running_) drop(*s);
    for (auto& s : waiting_) drop(*s);
    std::erase_if(running_, [](const auto& s) { return s->done; });
    std::erase_if(waiting_, [](const auto& s) { return s->done; });
  }

  /// Finishes a request: its blocks back to the pool (full ones stay cached), its stream told.
  void end(Sequence& s, FinishReason reason, std::string error = {}) {
    s.store.release();
    s.done = true;
    switch (reason) {
      case FinishReason::kCancelled:
        ++m_.cancelled;
        break;
      case FinishReason::kError:
        ++m_.failed;
        break;
      default:
        ++m_.finished;
    }
    s.stream->finish(reason, s.usage, std::move(error));
  }

  // ---------------------------------------------------------------------------------------------
  // Planning a step.

  /// Blocks s's store takes to append n tokens: the new ones, plus a copy of a shared or cached
  /// partly filled last block (PagedStore::begin_append's rule).
  std::size_t blocks_needed(const Sequence& s, std::size_t n) const {
    const std::size_t bs = pool_.block_size();
    const std::size_t size = s.store.size();
    const auto table = s.store.block_table();
    const std::size_t fresh = (size + n + bs - 1) / bs - table.size();
    return fresh + (shared_tail(s) ? 1 : 0);
  }
  bool shared_tail(const Sequence& s) const {
    const auto table = s.store.block_table();
    return s.store.size() % pool_.block_size() != 0 &&
           (pool_.ref_count(table.back()) > 1 || pool_.is_cached(table.back()));
  }
  /// The most tokens s can append with `blocks` blocks.
  std::size_t rows_fitting(const Sequence& s, std::size_t blocks) const {
    const std::size_t bs = pool_.block_size();
    const std::size_t partial = s.store.size() % bs;
    if (shared_tail(s)) {
      if (blocks == 0) return 0;
      --blocks;
    }
    const std::size_t room = s.store.block_table().size() * bs - s.store.size();
    return (partial != 0 ? room : 0) + blocks * bs;
  }
  /// Blocks the pool can still give this step, after those planned.
  std::size_t available() const { return pool_.n_available() - planned_blocks_; }

  void plan(Sequence& s, std::size_t n) {
    planned_blocks_ += blocks_needed(s, n);
    s.planned = true;
    s.rows = n;
    s.plan_rank = batch_.size();
    batch_.push_back(&s);
    stores_.push_back(&s.store);
    lengths_.push_back(n);
    const auto first = s.tokens.begin() + static_cast<std::ptrdiff_t>(s.store.size());
    batch_tokens_.insert(batch_tokens_.end(), first, first + static_cast<std::ptrdiff_t>(n));
  }

  /// Preemption by recomputation: running_[i] releases its blocks and goes to the front of the
  /// queue, keeping its tokens and sampler.
  void preempt(std::size_t i) {
    Sequence& s = *running_[i];
    s.store.release();
    ++s.usage.preemptions;
    ++m_.preemptions;
    waiting_.push_front(std::move(running_[i]));
    running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  void plan_batch() {
    batch_.clear();
    stores_.clear();
    lengths_.clear();
    batch_tokens_.clear();
    planned_blocks_ = 0;
    for (auto& s : running_) s->planned = false;
    std::size_t budget = options_.step_tokens;
    // 1. One token for each decoding sequence, oldest first; the newest give way.
    for (std::size_t i = 0; i < running_.size(); ++i) {
      Sequence& s = *running_[i];
      if (s.tokens.size() - s.store.size() != 1 || s.target == s.tokens.size()) continue;
      const std::size_t need = blocks_needed(s, 1);
      while (need > available() && running_.size() - 1 > i) preempt(running_.size() - 1);
      if (need > available()) {
        preempt(i);  // the newest itself: it waits for blocks
        break;
      }
      plan(s, 1);
      --budget;
    }
    // 2. The next chunk of each sequence still prefilling, as far as budget and blocks go.
    for (auto& p : running_) {
      Sequence& s = *p;
      if (s.planned || budget == 0) continue;
      const std::size_t n =
          std::min({s.tokens.size() - s.store.size(), budget, rows_fitting(s, available())});
      if (n == 0) continue;
      plan(s, n);
      budget -= n;
    }
    // 3. Admission in arrival order (preempted requests first): a slot, budget and blocks for
    // the request's tokens as if nothing were cached (one more for a copy-on-write of a fully
    // cached prompt's last block) — or an idle pool, which any accepted request fits.
    const std::size_t bs = pool_.block_size();
    while (!waiting_.empty() && running_.size() < options_.max_running && budget > 0) {
      Sequence& s = *waiting_.front();
      const std::size_t worst = (s.tokens.size() + bs - 1) / bs + 1;
      if (worst > available() && !running_.empty()) break;
      admit(s);
      running_.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
      const std::size_t n =
          std::min({s.tokens.size() - s.store.size(), budget, rows_fitting(s, available())});
      if (n == 0) continue;
      plan(s, n);
      budget -= n;
    }
    // Every running sequence prefilling and none with blocks for a row: the newest gives way so
    // the others can go on.
    if (batch_.empty() && running_.size() > 1) preempt(running_.size() - 1);
  }

  void admit(Sequence& s) {
    const Clock::time_point now = Clock::now();
    const std::uint64_t memory_hits = pool_.stats().hits;
    s.store = PagedStore<T>::open(pool_, s.tokens);  // memory, then the tier's files
    s.target = s.tokens.size();
    if (!s.admitted_before) {
      s.admitted_before = true;
      // Blocks after the first one loaded from disk cannot be in memory (their parent entry is
      // new), so the memory hits are the first blocks and the rest of the match came from disk.
      const std::size_t from_memory =
          std::min(s.store.size(), (pool_.stats().hits - memory_hits) * pool_.block_size());
      s.usage.cached_tokens = s.store.size();
      s.usage.cached_from_disk_tokens = s.store.size() - from_memory;
      s.usage.queue_ms = ms_between(s.submitted, now);
      m_.prompt_tokens += s.prompt_size;
      m_.tokens_reused += s.store.size();
      m_.tokens_from_disk += s.usage.cached_from_disk_tokens;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Running a step.

  /// Where a planned sequence runs in the step: decoding, completing its prompt (it samples its
  /// first token after its pass), or a prompt chunk that does not complete.
  enum class Role { kDecoding, kCompleting, kChunk };
  Role role(const Sequence& s) const {
    if (s.store.size() >= s.target) return Role::kDecoding;
    return s.store.size() + s.rows == s.tokens.size() ? Role::kCompleting : Role::kChunk;
  }

  /// Runs the step's planned work in the sub-passes SubPassPlanner chooses (one pass without
  /// sub_passes or a cost estimate).
  void run_batch() {
    const std::optional<PassCost> cost =
        options_.pass_cost ? options_.pass_cost : cost_model_.estimate();
    if (!options_.sub_passes || !cost) {
      run_pass(0, batch_.size());
    } else {
      order_batch();
      std::size_t decoders = 0, chunks = 0, rest_tokens = 0;
      prompt_rows_.clear();
      for (const Sequence* s : batch_) {
        switch (role(*s)) {
          case Role::kDecoding:
            ++decoders;
            break;
          case Role::kCompleting:
            prompt_rows_.push_back(s->rows);
            break;
          case Role::kChunk:
            ++chunks;
            rest_tokens += s->rows;
        }
      }
      const std::size_t prompts = prompt_rows_.size();
      const auto ends =
          planner_.plan({.decoders = decoders,
                         .prompts = prompt_rows_,
                         .rest_tokens = rest_tokens,
                         .waiting = chunks + (running_.size() - batch_.size()) + waiting_.size()},
                        *cost);
      // Item i < prompts is batch_[decoders + i]; the item after the prompts is every chunk.
      std::size_t begin = 0;
      for (const std::size_t end : ends) {
        const std::size_t last = end > prompts ? batch_.size() : decoders + end;
        run_pass(begin, last);
        begin = last;
      }
    }
    std::erase_if(running_, [](const auto& s) { return s->done; });
  }

  /// Puts batch_ in run order: decoding sequences, then completing prompts (fewest rows first),
  /// then the chunks; planning order within each. stores_, lengths_ and batch_tokens_ follow.
  void order_batch() {
    std::sort(batch_.begin(), batch_.end(), [this](const Sequence* a, const Sequence* b) {
      const Role ra = role(*a), rb = role(*b);
      if (ra != rb) return ra < rb;
      if (ra == Role::kCompleting && a->rows != b->rows) return a->rows < b->rows;
      return a->plan_rank < b->plan_rank;
    });
    stores_.clear();
    lengths_.clear();
    batch_tokens_.clear();
    for (Sequence* s : batch_) {
      stores_.push_back(&s->store);
      lengths_.push_back(s->rows);
      const auto first = s->tokens.begin() + static_cast<std::ptrdiff_t>(s->store.size());
      batch_tokens_.insert(batch_tokens_.end(), first,
                           first + static_cast<std::ptrdiff_t>(s->rows));
    }
  }

  /// One Model::prefill_batch pass over batch_[begin, end), then the draws of the sequences in
  /// it whose tokens are all computed, pushed to their streams before the next pass starts.
  void run_pass(std::size_t begin, std::size_t stop) {
    std::size_t token_begin = 0, tokens = 0;
    for (std::size_t b = 0; b < stop; ++b) (b < begin ? token_begin : tokens) += lengths_[b];
    const std::size_t n = stop - begin;
    const std::span<Sequence* const> seqs(batch_.data() + begin, n);
    std::span<const T> logits;
    const Clock::time_point start = Clock::now();
    try {
      logits = model_.prefill_batch(
          std::span<const std::int32_t>(batch_tokens_).subspan(token_begin, tokens),
          std::span<const std::size_t>(lengths_).subspan(begin, n),
          std::span<PagedStore<T>* const>(stores_).subspan(begin, n), act_);
    } catch (const Error& e) {
      // The pass left its stores as they were; its requests cannot go on.
      for (Sequence* s : seqs) end(*s, FinishReason::kError, e.what());
      return;
    }
    cost_model_.add(tokens, ms_between(start, Clock::now()));
    ++m_.passes;
    const auto vocab = static_cast<std::size_t>(model_.config().vocab_size);
    sampling_.clear();
    for (std::size_t b = begin; b < stop; ++b) {
      Sequence& s = *batch_[b];
      const std::size_t end_pos = s.store.size();
      const std::size_t first = end_pos - lengths_[b];
      const std::size_t prompt_rows = std::min(end_pos, s.target) - std::min(first, s.target);
      if (s.usage.preemptions == 0) {
        s.usage.prefilled_tokens += prompt_rows;
        m_.tokens_prefilled += prompt_rows;
      } else {
        s.usage.recomputed_tokens += prompt_rows;
        m_.tokens_recomputed += prompt_rows;
      }
      if (end_pos == s.tokens.size()) sampling_.push_back({b, 0});
    }
    draw_tokens(logits, begin, vocab);
    for (const Draw& d : sampling_) append_token(*batch_[d.batch_index], d.token);
    // One wake-up for the readers of every stream that got a token (RequestStream::next_for).
    if (!sampling_.empty()) readers_->wake_all();
  }

  /// The next token of every sequence in sampling_, from its row of the pass's logits
  /// [B][vocab] (row batch_index - begin). Each
  /// sequence has its own Sampler (softmax, sort and generator state over the whole vocabulary),
  /// so the draws are shared out on the step's threads; the token of a sequence does not depend
  /// on which thread drew it.
  void draw_tokens(std::span<const T> logits, std::size_t begin, std::size_t vocab) {
    const auto draw = [&](std::size_t i, std::size_t) {
      Draw& d = sampling_[i];
      Sequence& s = *batch_[d.batch_index];
      // The repetition penalty sees the latest repeat_last_n tokens, as generate() keeps them.
      const SamplerOptions& so = s.sampler.options();
      const std::size_t last_n =
          so.repeat_penalty != 1.0 ? std::min(so.repeat_last_n, pool_.capacity()) : 0;
      const std::span<const std::int32_t> all(s.tokens);
      d.token = s.sampler.sample(logits.subspan((d.batch_index - begin) * vocab, vocab),
                                 all.last(std::min(last_n, all.size())));
    };
    run_items(options_.thread_pool, sampling_.size(), draw);  // one draw stays on the caller
  }

  /// Appends a drawn token to s and tells its stream; ends s on a stop token, at max_tokens or
  /// with a full context.
  void append_token(Sequence& s, std::int32_t token) {
    s.tokens.push_back(token);  // within the reservation
    ++s.usage.generated_tokens;
    ++m_.tokens_generated;
    const Clock::time_point now = Clock::now();
    if (s.generated() == 1) {
      s.usage.ttft_ms = ms_between(s.submitted, now);
      m_.ttft.add(s.usage.ttft_ms);
    } else {
      m_.itl.add(ms_between(s.last_token, now));
    }
    s.last_token = now;
    if (s.on_token) {
      try {
        s.on_token(token);
      } catch (const std::exception& e) {
        end(s, FinishReason::kError, std::string("on_token threw: ") + e.what());
        return;
      }
    }
    s.stream->push(token, s.usage);
    if (std::find(s.stop_tokens.begin(), s.stop_tokens.end(), token) != s.stop_tokens.end()) {
      end(s, FinishReason::kStopToken);
    } else if (s.generated() == s.max_tokens) {
      end(s, FinishReason::kMaxTokens);
    } else if (s.store.size() == pool_.capacity()) {
      end(s, FinishReason::kContextFull);
    }
  }

  void publish() {
    m_.queued = waiting_.size();
    m_.running = running_.size();
    m_.blocks_total = pool_.n_blocks();
    m_.blocks_held = pool_.n_held();
    m_.blocks_free = pool_.n_free();
    m_.blocks_cached = pool_.n_evictable();
    m_.prefix_block_hits = pool_.stats().hits;
    m_.evictions = pool_.stats().evictions;
    if (tier_) {
      m_.prefix_tier = true;
      m_.tier = tier_->stats();
    }
    m_.prefix_block_disk_hits = m_.tier.disk_hits;
    m_.prefix_block_misses = pool_.stats().misses - m_.tier.disk_hits;
    std::lock_guard lock(published_mutex_);
    published_ = m_;
  }

  const Model<T, W>& model_;
  const EngineOptions options_;
  // Before the pool, so that a bad prefix_dir throws before the pool's memory is taken; attached
  // in the constructor's body and detached in the destructor's, while the pool lives.
  std::unique_ptr<PrefixTier<T>> tier_;
  BlockPool<T> pool_;
  Activations<T> act_;
  std::shared_ptr<detail::WakeSignal> wake_;
  // Shared with every stream: their readers wait on it after their first token.
  std::shared_ptr<detail::ReaderSignal> readers_ = std::make_shared<detail::ReaderSignal>();

  // Submissions, shared with other threads.
  mutable std::mutex incoming_mutex_;
  std::vector<std::unique_ptr<Sequence>> incoming_;
  std::uint64_t next_id_ = 0;
  std::uint64_t submitted_ = 0;

  // The step thread's own state.
  std::deque<std::unique_ptr<Sequence>> waiting_;   // queued, arrival order, preempted first
  std::vector<std::unique_ptr<Sequence>> running_;  // [≤ max_running] admission order
  std::vector<Sequence*> batch_;                    // [≤ max_running] planned this step
  std::vector<PagedStore<T>*> stores_;              // [≤ max_running] their stores
  std::vector<std::size_t> lengths_;                // [≤ max_running] tokens of each this step
  std::vector<std::int32_t> batch_tokens_;          // [≤ step_tokens] concatenated
  std::vector<std::size_t> prompt_rows_;  // [≤ max_running] rows of the completing prompts
  SubPassPlanner planner_;
  PassCostModel cost_model_;
  struct Draw {
    std::size_t batch_index;  // the sequence's row in batch_ and in the step's logits
    std::int32_t token;       // what its sampler drew
  };
  std::vector<Draw> sampling_;  // [≤ max_running] the sequences that sample this step
  std::size_t planned_blocks_ = 0;
  EngineMetrics m_;

  mutable std::mutex published_mutex_;
  EngineMetrics published_;
};

}  // namespace kvdecode
