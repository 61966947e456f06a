// Tokenizers built from GGUF metadata alone: SentencePiece-style (`tokenizer.ggml.model = llama`) and
// byte-level BPE (`gpt2`: Llama-3.x, Qwen2.5, Qwen3), as llama.cpp tokenizes them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace locks {

class GgufFile;
struct BpeModel;

/// Token ids are int32. Two kinds, chosen by `tokenizer.ggml.model`:
///  - "llama" (SentencePiece): reproduces the SentencePiece library's BPE encoding of the vocabularies
///    in ../shared/models (tokenizer-vectors.json): add_space_prefix, spaces as U+2581 "▁",
///    user-defined tokens matched as atomic pieces, score-driven pair merges, `<0xNN>` byte fallback.
///  - "gpt2" (byte-level BPE): the pre-tokenizer named by `tokenizer.ggml.pre` ("llama-bpe", "qwen2";
///    src/llm/pretokenize.h), GPT-2's byte-to-unicode alphabet, merges by rank from
///    `tokenizer.ggml.merges` (src/llm/bpe_tokenizer.h); reproduces llama.cpp's ids on its tokenizer
///    test vectors (../shared/models/families/tokenizer-*.inp/.out). Invalid UTF-8 keeps its bytes
///    (llama.cpp turns each into U+FFFD's tokens), so decode(encode(s)) == s for every byte string.
class Tokenizer {
 public:
  enum class Kind { kSentencePiece, kByteLevelBpe };
  /// GGUF token types (llama.cpp's llama_token_type).
  enum TokenType : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

  /// Build from `tokenizer.ggml.*` keys. Throws std::runtime_error naming the missing/invalid key
  /// (a model other than "llama" or "gpt2", a `pre` other than "llama-bpe" or "qwen2", missing or
  /// malformed merges, arrays of different lengths, special ids out of range).
  static Tokenizer from_gguf(const GgufFile& gguf);

  /// Encode UTF-8 text. Prepends BOS when add_bos (throws if the vocabulary has none).
  /// parse_special: control tokens written in the text (`<|begin_of_text|>`, `<|im_start|>`) become
  /// those tokens; otherwise they are text like any other. User-defined tokens are always matched
  /// (llama.cpp's rule). Special tokens are cut out longest first, then the text between them is
  /// encoded piece by piece (each piece gets SentencePiece's space prefix).
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special = false) const;
  /// Bytes of one token as it appears in running text ("▁" -> ' ', <0xNN> -> byte, byte-level
  /// characters -> their bytes, user-defined -> its text, control and unused -> "").
  std::string token_to_piece(int32_t id) const;
  /// Detokenize a sequence: concatenated pieces; SentencePiece: the leading space of the first piece
  /// removed when add_space_prefix is set (as SentencePiece does). Throws on ids out of range.
  std::string decode(std::span<const int32_t> ids) const;

  Kind kind() const { return kind_; }
  /// `tokenizer.ggml.pre` of a byte-level BPE vocabulary; "" for SentencePiece.
  const std::string& pre() const { return pre_; }
  int32_t n_vocab() const { return static_cast<int32_t>(pieces_.size()); }
  /// Beginning of sequence; -1 when a byte-level vocabulary has none (add_bos is then false).
  int32_t bos() const { return bos_; }
  int32_t eos() const { return eos_; }
  /// End of turn: `tokenizer.ggml.eot_token_id`, else the token "<|eot_id|>" (Llama-3) or
  /// "<|im_end|>" (ChatML: Qwen), else eos().
  int32_t eot() const { return eot_; }
  /// Whether generation stops at `id`: eos(), eot(), or a control token "<|eot_id|>", "<|eom_id|>",
  /// "<|im_end|>", "<|endoftext|>", "<|end_of_text|>" (llama.cpp's end-of-generation set).
  bool is_end_of_generation(int32_t id) const;
  int32_t unk() const { return unk_; }
  bool add_bos() const { return add_bos_; }
  /// The id of the vocabulary entry whose stored text is `text` (e.g. "<|im_start|>"), -1 if none.
  /// A text stored twice gives its last id.
  int32_t token_id(std::string_view text) const;
  /// The vocabulary entry of `id` as stored. Throws std::out_of_range for an id outside the vocabulary.
  const std::string& piece(int32_t id) const;
  /// The TokenType of `id`. Throws std::out_of_range for an id outside the vocabulary.
  int32_t token_type(int32_t id) const;
  /// A lower bound on encode(text, false).size() without encoding (O(text) bytes, no allocation):
  /// the bytes left after the whitespace squeeze (when the vocabulary squeezes), divided by the most
  /// bytes of text one token covers (SentencePiece: a "▁" in a piece stands for one space; at least 4,
  /// the bytes of one character that falls back to <unk>).
  size_t min_tokens(std::string_view text) const;

 private:
  // SentencePiece encoding of text without special tokens, appended to out.
  void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
  // from_gguf's parts: the byte-level BPE keys; the special-token lists and end-of-turn ids.
  void load_bpe(const GgufFile& gguf);
  void finish_special_tokens(const GgufFile& gguf);
  Kind kind_ = Kind::kSentencePiece;
  std::string pre_;
  std::shared_ptr<const BpeModel> bpe_;  // byte-level BPE only
  // Control, user-defined and unknown tokens (those encode() may cut out of the text), longest first.
  std::vector<int32_t> special_ids_;
  std::vector<int32_t> eog_ids_;
  int32_t eot_ = 2;
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
  // Every entry by its text, last id on duplicates (SentencePiece; byte-level BPE has its own).
  std::unordered_map<std::string, int32_t, PieceHash, std::equal_to<>> text_to_id_;
  bool add_bos_ = true;
  bool add_space_prefix_ = true;
  // SentencePiece's normalizer option (strip leading/trailing spaces, collapse runs). GGUF rarely
  // stores it, so from_gguf infers it from the vocabulary when the key is absent.
  bool remove_extra_whitespaces_ = false;
};

}  // namespace locks
