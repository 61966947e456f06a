#include "locks/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <span>
#include <stdexcept>

namespace locks {

namespace {
std::string tokens(int64_t n) { return fmt::format("{} token{}", n, n == 1 ? "" : "s"); }
}  // namespace

GenerateResult generate(Session& session, const std::vector<int32_t>& prompt_ids, const GenerateOptions& opts,
                        const std::function<void(int32_t)>& on_token) {
  const int n_prompt = static_cast<int>(prompt_ids.size());
  if (n_prompt == 0) throw std::invalid_argument("empty prompt");
  if (session.n_tokens() != 0)
    throw std::logic_error(fmt::format("generate: the session already holds {} (generate starts a fresh one)",
                                       tokens(session.n_tokens())));
  if (opts.decode_tail < 0 || opts.decode_tail >= n_prompt)
    throw std::invalid_argument(fmt::format("decode tail {} must be in [0, {}) for a prompt of {}", opts.decode_tail,
                                            n_prompt, tokens(n_prompt)));
  if (opts.max_tokens < 0) throw std::invalid_argument("max tokens must be >= 0");
  // The last generated token is sampled, never decoded: the cache holds n_prompt + max_tokens - 1.
  const int64_t positions = int64_t(n_prompt) + std::max(opts.max_tokens - 1, 0);
  if (positions > session.n_ctx())
    throw std::length_error(
        fmt::format("prompt of {} + {} to generate needs {} KV-cache positions (the last "
                    "generated token is not stored), more than the context size of {}",
                    tokens(n_prompt), opts.max_tokens, positions, tokens(session.n_ctx())));
  GenerateResult res;
  res.prompt_ids = prompt_ids;
  const int n_prefill = n_prompt - opts.decode_tail;
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<float>* logits = &session.prefill(std::span<const int32_t>(prompt_ids.data(), size_t(n_prefill)));
  res.prefill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.prefill_tokens = n_prefill;
  for (int i = n_prefill; i < n_prompt; ++i) logits = &session.decode(prompt_ids[i]);

  Sampler sampler(opts.sampler);
  const int32_t eos = session.model().tokenizer.eos();
  for (int i = 0; i < opts.max_tokens; ++i) {
    const int32_t id = sampler.sample(*logits);
    if (opts.stop_at_eos && id == eos) break;
    res.generated_ids.push_back(id);
    if (on_token) on_token(id);
    if (i + 1 < opts.max_tokens) logits = &session.decode(id);
  }
  res.decode = session.totals();
  // Pieces as running text (a continuation keeps its leading space, unlike a full decode()).
  for (int32_t id : res.generated_ids) res.text += session.model().tokenizer.token_to_piece(id);
  return res;
}

}  // namespace locks
