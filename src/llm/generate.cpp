#include "locks/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <span>
#include <stdexcept>

namespace locks {

namespace {
std::string tokens(int64_t n) { return fmt::format("{} token{}", n, n == 1 ? "" : "s"); }
}  // namespace

std::vector<TokenLogprob> top_logprobs(const std::vector<float>& logits, int n) {
  if (logits.empty() || n <= 0) return {};
  double m = -std::numeric_limits<double>::infinity();
  for (float x : logits) {
    if (std::isnan(x)) throw std::invalid_argument("top logprobs: the logits hold NaN");
    m = std::max(m, double(x));
  }
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x) - m);
  const double log_z = m + std::log(sum);
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  const size_t k = std::min(ids.size(), size_t(n));
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[size_t(a)] != logits[size_t(b)] ? logits[size_t(a)] > logits[size_t(b)] : a < b;
  });
  std::vector<TokenLogprob> out(k);
  for (size_t i = 0; i < k; ++i) out[i] = {ids[i], double(logits[size_t(ids[i])]) - log_z};
  return out;
}

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
  if (opts.top_logprobs < 0) throw std::invalid_argument("top logprobs must be >= 0");
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
  const Tokenizer& tok = session.model().tokenizer;
  for (int i = 0; i < opts.max_tokens; ++i) {
    if (opts.top_logprobs > 0) res.top_logprobs.push_back(top_logprobs(*logits, opts.top_logprobs));
    const int32_t id = sampler.sample(*logits);
    if (opts.stop_at_eos && tok.is_end_of_generation(id)) break;
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
