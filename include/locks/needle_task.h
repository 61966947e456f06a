// Needle-retrieval tasks in the reference model's training format (../shared/MODELS.md):
//   needle   "Remember: the magic number for {key} is {value}."  (own line, "\n" before and after)
//   question "Question: what is the magic number for {key}? Answer: the magic number for {key} is"
//   answer   " {value}" — "▁" then seven digit tokens
// Haystacks are whole lines of real held-out documents.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "locks/tokenizer.h"

namespace locks {

enum class NeedleFamily {
  kSingle,      // one needle, ask it
  kMultiKey,    // four needles, ask one
  kMultiQuery,  // four needles, ask two (both must be right)
};
std::string needle_family_name(NeedleFamily f);
NeedleFamily parse_needle_family(const std::string& s);  // "single" | "multikey" | "multiquery"

struct NeedleQuestion {
  std::string key, value;
  int needle = 0;                   // index into NeedleTask::keys of the needle asked
  std::vector<int32_t> prompt_ids;  // "\nQuestion: ... is" (decoded before the answer; for the
                                    // second question this starts with the "." ending answer 1)
  std::vector<int32_t> answer_ids;  // "▁" + 7 digits, teacher-forced and scored
};

struct NeedleTask {
  NeedleFamily family = NeedleFamily::kSingle;
  int target_tokens = 0;
  std::vector<int32_t> context_ids;   // BOS + haystack with needles (prefilled densely)
  std::vector<double> needle_depths;  // fraction of the context where each needle starts
  std::vector<int32_t> needle_pos;    // token position of each needle's first token
  std::vector<int32_t> value_pos;     // token position of each needle's value (" {value}" starts)
  std::vector<std::string> keys, values;
  std::vector<NeedleQuestion> questions;
  int total_tokens() const;  // context + every question and answer
};

/// Build one task of ~target_tokens tokens in total (context + questions + answers), deterministic
/// for (docs, family, target_tokens, seed). Needles sit at depths spread evenly over the context
/// with seeded jitter. Throws std::invalid_argument when target_tokens < 256 or the documents hold
/// too little text.
NeedleTask make_needle_task(const std::vector<std::string>& docs, const Tokenizer& tok, NeedleFamily family,
                            int target_tokens, uint64_t seed);

/// Held-out text for the `continuation` task: BOS + whole lines from a seeded start, exactly
/// `n_tokens` tokens (the last `n_tokens - prefix` of them are teacher-forced through decode).
/// Throws std::invalid_argument when the documents hold too little text.
std::vector<int32_t> make_text_tokens(const std::vector<std::string>& docs, const Tokenizer& tok, int n_tokens,
                                      uint64_t seed);

}  // namespace locks
