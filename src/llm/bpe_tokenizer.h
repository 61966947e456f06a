// Byte-level BPE (GPT-2's scheme; GGUF `tokenizer.ggml.model = gpt2`): text bytes as characters of
// the byte-to-unicode alphabet, split into words by the pre-tokenizer, each word merged pair by pair
// in the order of `tokenizer.ggml.merges` (lowest rank first, leftmost among equals), as llama.cpp's
// llm_tokenizer_bpe_session does. Internal to Tokenizer (include/locks/tokenizer.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "pretokenize.h"

namespace locks {

/// GPT-2's byte-to-unicode map: bytes 0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF are their own code point, the
/// other 68 bytes map in order to U+0100, U+0101, ... (so " " is "Ġ" U+0120, "\n" is "Ċ" U+010A).
uint32_t gpt2_byte_to_cpt(uint8_t byte);

struct BpeModel {
  struct TextHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  struct Merge {
    int32_t rank;    // index in tokenizer.ggml.merges: lower merges first
    int32_t result;  // token of the two texts joined
  };

  PreTokenizer pre = PreTokenizer::kLlama3;
  bool ignore_merges = false;  // llama-bpe: a word that is itself a token is that token, unmerged
  int32_t byte_token[256] = {};
  std::string byte_text[256];  // each byte as its byte-to-unicode character (UTF-8)
  // Every vocabulary entry by its text; a text stored twice maps to its last id (llama.cpp's
  // token_to_id, which the merge and word lookups go through).
  std::unordered_map<std::string, int32_t, TextHash, std::equal_to<>> token_to_id;
  std::unordered_map<uint64_t, Merge> merges;  // key: left id << 32 | right id
  std::vector<std::string> piece_bytes;        // normal tokens: their text mapped back to bytes

  /// Build from the vocabulary (texts and token types, same length) and the merges ("left right",
  /// split at the first space after the first byte). Throws std::runtime_error beginning with `where`
  /// when a byte's character is not a token, or a merge is not two pieces or names a piece (left,
  /// right or joined) that is not a token (the merges must stay inside the vocabulary, as Hugging
  /// Face's tokenizers require, so that every word ends as tokens and decodes back to its bytes).
  static BpeModel build(const std::vector<std::string>& pieces, const std::vector<int32_t>& types,
                        const std::vector<std::string>& merge_list, PreTokenizer pre, const std::string& where);

  /// Append the tokens of `text` (no special tokens in it: the caller has split them out).
  void encode(std::string_view text, std::vector<int32_t>& out) const;
};

}  // namespace locks
