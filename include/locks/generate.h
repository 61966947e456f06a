// The generation loop of `locks run`: prefill (dense), optional decode tail, then sampling.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "locks/sampler.h"
#include "locks/session.h"

namespace locks {

struct GenerateOptions {
  int max_tokens = 32;      // tokens to generate after the prompt
  int decode_tail = 0;      // last N prompt tokens go through decode (selection runs on them)
  bool stop_at_eos = true;  // stop at the end-of-generation tokens (EOS, the end-of-turn token)
  SamplerConfig sampler;
  /// Report the top_logprobs most likely tokens at each generated position (0: none), as OpenAI-style
  /// APIs do: natural-log softmax of the logits at temperature 1 (whatever the sampler's temperature),
  /// from the attention the run uses (full, or the selected pages).
  int top_logprobs = 0;
};

/// One candidate token at a generated position.
struct TokenLogprob {
  int32_t id = 0;
  double logprob = 0;  // ln softmax(logits)[id], temperature 1
};

/// The n most likely tokens of `logits` [n_vocab], most likely first (ties: the lower id first), with
/// their natural-log softmax probabilities computed in float64. n is clamped to n_vocab; NaN logits
/// throw std::invalid_argument.
std::vector<TokenLogprob> top_logprobs(const std::vector<float>& logits, int n);

struct GenerateResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> generated_ids;
  std::string text;  // detokenized generated_ids
  int prefill_tokens = 0;
  double prefill_seconds = 0;
  DecodeTotals decode;  // over the decode tail and the generated tokens
  /// With GenerateOptions::top_logprobs: one list per generated token (the position it was sampled
  /// at), the most likely first. The list of a sampled end-of-sequence token that stopped the run is
  /// kept, so this may hold one list more than generated_ids.
  std::vector<std::vector<TokenLogprob>> top_logprobs;
};

/// Run the prompt through `session` (fresh) and generate. `on_token` (optional) sees each generated
/// id as it is produced, for streaming. Throws std::invalid_argument for an empty prompt, negative
/// max_tokens, negative top_logprobs, or a decode_tail that is negative or leaves no token to prefill;
/// std::length_error when the prompt plus max_tokens - 1 (the last token is sampled, never stored) exceed the session's
/// context; std::logic_error when the session already holds tokens; and whatever Session throws
/// (bad ids).
GenerateResult generate(Session& session, const std::vector<int32_t>& prompt_ids, const GenerateOptions& opts,
                        const std::function<void(int32_t)>& on_token = {});

}  // namespace locks
