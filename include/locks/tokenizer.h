// SentencePiece-style ("llama" vocab type in llama.cpp) tokenizer built from GGUF metadata alone.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace locks {

class GgufFile;

/// Token ids are int32. Reproduces the SentencePiece library's BPE encoding of the vocabularies in
/// ../shared/models (tokenizer-vectors.json): add_space_prefix, spaces as U+2581 "▁",
/// user-defined tokens matched as atomic pieces, score-driven pair merges, `<0xNN>` byte fallback.
class Tokenizer {
 public:
  /// Build from `tokenizer.ggml.*` keys. Throws std::runtime_error naming the missing/invalid key
  /// (e.g. model not "llama", arrays of different lengths, special ids out of range).
  static Tokenizer from_gguf(const GgufFile& gguf);

  /// Encode UTF-8 text (invalid UTF-8 bytes go through byte fallback). Prepends BOS when add_bos.
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;
  /// Bytes of one token as it appears in running text ("▁" -> ' ', <0xNN> -> byte, control -> "").
  std::string token_to_piece(int32_t id) const;
  /// Detokenize a sequence: concatenated pieces, the leading space of the first piece removed
  /// when add_space_prefix is set (as SentencePiece does). Throws on ids out of range.
  std::string decode(std::span<const int32_t> ids) const;

  int32_t n_vocab() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos() const { return bos_; }
  int32_t eos() const { return eos_; }
  int32_t unk() const { return unk_; }
  bool add_bos() const { return add_bos_; }
  /// The vocabulary entry of `id` as stored. Throws std::out_of_range for an id outside the vocabulary.
  const std::string& piece(int32_t id) const;
  /// A lower bound on encode(text, false).size() without encoding (O(text) bytes, no allocation):
  /// the bytes left after the whitespace squeeze (when the vocabulary squeezes), divided by the most
  /// bytes of text one token covers (a "▁" in a piece stands for one space; at least 4, the bytes of
  /// one character that falls back to <unk>).
  size_t min_tokens(std::string_view text) const;

 private:
  std::vector<std::string> pieces_;
  size_t max_text_bytes_ = 4;  // the most bytes of text one token covers
  // The text encode() tokenizes: without leading and trailing spaces when the vocabulary squeezes.
  std::string_view trimmed_for_encode(std::string_view text) const;
  std::vector<float> scores_;
  std::vector<int32_t> types_;  // 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
  // Transparent hash so the merge loop can look up string_views into the text without copying.
  struct PieceHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  // Pieces that merges may produce (normal, user-defined, unused), as SentencePiece's BPE does.
  std::unordered_map<std::string, int32_t, PieceHash, std::equal_to<>> piece_to_id_;
  std::vector<int32_t> user_defined_;  // ids of user-defined tokens, longest first
  int32_t byte_ids_[256] = {};         // id of <0xNN>, or -1 when the vocabulary lacks it
  bool user_first_byte_[256] = {};     // quick reject before trying user-defined matches
  int32_t bos_ = 1, eos_ = 2, unk_ = 0;
  bool add_bos_ = true;
  bool add_space_prefix_ = true;
  // SentencePiece's normalizer option (strip leading/trailing spaces, collapse runs). GGUF rarely
  // stores it, so from_gguf infers it from the vocabulary when the key is absent.
  bool remove_extra_whitespaces_ = false;
};

}  // namespace locks
