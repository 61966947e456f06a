// The pre-tokenizers of byte-level BPE vocabularies (`tokenizer.ggml.pre`): text -> words, each then
// merged on its own. A hand-written matcher of the regexes below over code points (leftmost match,
// alternatives in order, greedy with the regex's backtracking), as llama.cpp runs them.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace locks {

/// `llama-bpe` (Llama-3.x; tiktoken's cl100k pattern) and `qwen2` (Qwen2, Qwen2.5, Qwen3) differ in
/// the digits alternative only (\p{N}{1,3} against \p{N}):
///   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
///   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
/// (the `pre_tokenizer` Split pattern of their tokenizer.json; llama.cpp src/llama-vocab.cpp). The case
/// folding of the contractions is ASCII-only ('[sS]'), as llama.cpp's form of the pattern has it.
enum class PreTokenizer { kLlama3, kQwen2 };

/// The pre-tokenizer a `tokenizer.ggml.pre` value names. Throws std::runtime_error naming any other
/// value (and the supported ones).
PreTokenizer pre_tokenizer_from_name(const std::string& name);

/// Split `text` into words: appends to `ends` the byte offset one past each word, in order (word i is
/// [ends[i-1], ends[i]) of `text`, the first starting at 0; nothing for empty text). Every byte belongs
/// to exactly one word. Invalid UTF-8: each stray byte is one character classified as U+FFFD (a
/// symbol), so the split is llama.cpp's, which replaces it by U+FFFD; O(bytes).
void pretokenize(std::string_view text, PreTokenizer kind, std::vector<size_t>& ends);

}  // namespace locks
