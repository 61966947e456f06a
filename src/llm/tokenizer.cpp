// The Tokenizer: vocabulary loading for both kinds, special tokens cut out of the text, and the
// SentencePiece encoding (byte-level BPE: bpe_tokenizer.cpp, pretokenize.cpp).
// SentencePiece BPE encoding, reproduced from the GGUF vocabulary:
//  1. normalize: with remove_extra_whitespaces drop leading/trailing spaces and collapse runs;
//     prepend "▁" once (add_space_prefix); spaces -> "▁";
//  2. split into symbols: the longest user-defined piece at each position (frozen: never merged),
//     else one UTF-8 character (an invalid byte is a symbol of its own);
//  3. repeatedly merge the adjacent pair whose concatenation is a vocabulary piece with the highest
//     score; ties go to the leftmost pair (SentencePiece's agenda order). Stale agenda entries are
//     detected by the symbol lengths having changed;
//  4. pieces that are "unused" are split back into the pair that formed them;
//  5. symbols not in the vocabulary become <0xNN> byte tokens, one per UTF-8 byte.
#include "locks/tokenizer.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <stdexcept>

#include "bpe_tokenizer.h"
#include "locks/gguf.h"

namespace locks {

namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";         // U+2581 "▁"
constexpr std::string_view kUnkSurface = " \xE2\x81\x87 ";  // SentencePiece's rendering of <unk>
using TokenType = Tokenizer::TokenType;
constexpr TokenType kNormal = Tokenizer::kNormal, kUnknown = Tokenizer::kUnknown, kControl = Tokenizer::kControl,
                    kUserDefined = Tokenizer::kUserDefined, kUnused = Tokenizer::kUnused, kByte = Tokenizer::kByte;

// Length of the UTF-8 character starting at p (n bytes available); 1 for an invalid sequence so
// that every stray byte becomes its own symbol and goes through byte fallback.
size_t utf8_len(const unsigned char* p, size_t n) {
  const unsigned c = p[0];
  const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (len == 0 || len > n) return 1;
  for (size_t i = 1; i < len; ++i) {
    if ((p[i] & 0xC0) != 0x80) return 1;
  }
  return len;
}

// "<0xNN>" -> NN, or -1.
int parse_byte_piece(const std::string& s) {
  if (s.size() != 6 || s.compare(0, 3, "<0x") != 0 || s[5] != '>') return -1;
  int v = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = s[static_cast<size_t>(i)];
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                         : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

std::string replace_space_symbol(std::string_view piece) {
  std::string out;
  out.reserve(piece.size());
  for (size_t i = 0; i < piece.size();) {
    if (piece.compare(i, kSpace.size(), kSpace) == 0) {
      out += ' ';
      i += kSpace.size();
    } else {
      out += piece[i++];
    }
  }
  return out;
}

struct Symbol {
  size_t start = 0;  // byte offset into the normalized text
  size_t len = 0;    // 0 once merged into its left neighbour
  int prev = -1, next = -1;
  bool frozen = false;  // user-defined piece
};

struct Candidate {
  float score;
  int left, right;
  size_t size;  // left.len + right.len when queued; a mismatch later means the entry is stale
};

// Highest score first; among equal scores the leftmost pair.
struct CandidateOrder {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

}  // namespace

Tokenizer Tokenizer::from_gguf(const GgufFile& gguf) {
  auto fail = [&](const std::string& what) -> void {
    throw std::runtime_error("tokenizer from GGUF '" + gguf.name() + "': " + what);
  };
  const std::string model = gguf.get_string("tokenizer.ggml.model");
  if (model != "llama" && model != "gpt2")
    fail("tokenizer.ggml.model is " + gguf_quoted(model) +
         ", not one this tokenizer reads ('llama': SentencePiece, 'gpt2': byte-level BPE)");

  Tokenizer t;
  t.kind_ = model == "gpt2" ? Kind::kByteLevelBpe : Kind::kSentencePiece;
  t.pieces_ = gguf.get_string_array("tokenizer.ggml.tokens");
  const size_t n = t.pieces_.size();
  if (n == 0) fail("tokenizer.ggml.tokens is empty");
  if (n > static_cast<size_t>(INT32_MAX)) fail("tokenizer.ggml.tokens is too large");
  t.scores_ =
      gguf.has_key("tokenizer.ggml.scores") ? gguf.get_f32_array("tokenizer.ggml.scores") : std::vector<float>(n, 0.0f);
  t.types_ = gguf.has_key("tokenizer.ggml.token_type") ? gguf.get_i32_array("tokenizer.ggml.token_type")
                                                       : std::vector<int32_t>(n, kNormal);
  if (t.scores_.size() != n) {
    fail("tokenizer.ggml.scores has " + std::to_string(t.scores_.size()) + " entries, tokens has " + std::to_string(n));
  }
  if (t.types_.size() != n) {
    fail("tokenizer.ggml.token_type has " + std::to_string(t.types_.size()) + " entries, tokens has " +
         std::to_string(n));
  }
  // A corrupt score or type would silently change the tokenization (NaN also breaks the merge
  // agenda's strict ordering).
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(t.scores_[i])) fail("tokenizer.ggml.scores[" + std::to_string(i) + "] is NaN");
    if (t.types_[i] < kNormal || t.types_[i] > kByte)
      fail("tokenizer.ggml.token_type[" + std::to_string(i) + "] = " + std::to_string(t.types_[i]) +
           " is not a token type (1 normal .. 6 byte)");
  }

  auto special = [&](const char* key, int32_t fallback) {
    const uint32_t id = gguf.get_u32_or(key, static_cast<uint32_t>(fallback));
    if (id >= n)
      fail(std::string(key) + " = " + std::to_string(id) + " is out of range (vocab " + std::to_string(n) + ")");
    return static_cast<int32_t>(id);
  };
  if (t.kind_ == Kind::kByteLevelBpe) {
    t.load_bpe(gguf);
    t.finish_special_tokens(gguf);
    return t;
  }
  t.bos_ = special("tokenizer.ggml.bos_token_id", 1);
  t.eos_ = special("tokenizer.ggml.eos_token_id", 2);
  t.unk_ = special("tokenizer.ggml.unknown_token_id", 0);
  t.add_bos_ = gguf.get_bool_or("tokenizer.ggml.add_bos_token", true);
  t.add_space_prefix_ = gguf.get_bool_or("tokenizer.ggml.add_space_prefix", true);

  // The most text bytes one token covers: a normal piece's bytes with each "▁" (3 bytes) one space;
  // a user-defined piece may match literally, so all its bytes; a byte token 1; control none.
  for (size_t i = 0; i < n; ++i) {
    const std::string& p = t.pieces_[i];
    size_t covers = p.size();
    if (t.types_[i] == kByte) covers = 1;
    if (t.types_[i] == kControl) covers = 0;
    if (t.types_[i] == kNormal || t.types_[i] == kUnused)
      for (size_t at = p.find(kSpace); at != std::string::npos; at = p.find(kSpace, at + kSpace.size()))
        covers -= kSpace.size() - 1;
    t.max_text_bytes_ = std::max(t.max_text_bytes_, covers);
  }
  std::fill(std::begin(t.byte_ids_), std::end(t.byte_ids_), -1);
  t.piece_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    const int32_t type = t.types_[i];
    if (type == kNormal || type == kUserDefined || type == kUnused) {
      t.piece_to_id_.emplace(t.pieces_[i], id);  // first occurrence wins on duplicates
    }
    if (type == kUserDefined && !t.pieces_[i].empty()) {
      t.user_defined_.push_back(id);
      t.user_first_byte_[static_cast<unsigned char>(t.pieces_[i][0])] = true;
    }
    if (type == kByte) {
      const int b = parse_byte_piece(t.pieces_[i]);
      if (b >= 0 && t.byte_ids_[b] < 0) t.byte_ids_[b] = id;
    }
  }
  // SentencePiece's remove_extra_whitespaces (default on) is not in the usual GGUF keys. A vocabulary
  // trained with it on never saw two spaces in a row, so it cannot hold a piece containing "▁▁";
  // one that does (Llama 2, locks-ref) was trained with it off. stories260K has no such piece and
  // its reference encodings do collapse spaces. An explicit key, when present, wins.
  if (gguf.has_key("tokenizer.ggml.remove_extra_whitespaces")) {
    t.remove_extra_whitespaces_ = gguf.get_bool_or("tokenizer.ggml.remove_extra_whitespaces", false);
  } else {
    const std::string run = std::string(kSpace) + std::string(kSpace);
    t.remove_extra_whitespaces_ = std::none_of(t.pieces_.begin(), t.pieces_.end(),
                                               [&](const std::string& p) { return p.find(run) != std::string::npos; });
  }
  std::stable_sort(t.user_defined_.begin(), t.user_defined_.end(), [&](int32_t a, int32_t b) {
    return t.pieces_[static_cast<size_t>(a)].size() > t.pieces_[static_cast<size_t>(b)].size();
  });
  t.text_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i) t.text_to_id_[t.pieces_[i]] = static_cast<int32_t>(i);
  t.finish_special_tokens(gguf);
  return t;
}

void Tokenizer::load_bpe(const GgufFile& gguf) {
  const std::string where = "tokenizer from GGUF '" + gguf.name() + "': ";
  auto fail = [&](const std::string& what) -> void { throw std::runtime_error(where + what); };
  if (!gguf.has_key("tokenizer.ggml.pre"))
    fail("tokenizer.ggml.pre is missing (a byte-level BPE vocabulary names its pre-tokenizer: 'llama-bpe', 'qwen2')");
  pre_ = gguf.get_string("tokenizer.ggml.pre");
  PreTokenizer pre = PreTokenizer::kLlama3;
  try {
    pre = pre_tokenizer_from_name(pre_);
  } catch (const std::runtime_error& e) {
    fail(e.what());
  }
  if (!gguf.has_key("tokenizer.ggml.merges")) fail("tokenizer.ggml.merges is missing (byte-level BPE merges by them)");
  bpe_ = std::make_shared<const BpeModel>(
      BpeModel::build(pieces_, types_, gguf.get_string_array("tokenizer.ggml.merges"), pre, where));
  const size_t n = pieces_.size();
  // Ids from their keys; without one, the family's token of that role when the vocabulary has it.
  auto id_of = [&](const char* key, std::initializer_list<const char*> texts) -> int32_t {
    if (gguf.has_key(key)) {
      const uint32_t id = gguf.get_u32(key);
      if (id >= n)
        fail(std::string(key) + " = " + std::to_string(id) + " is out of range (vocab " + std::to_string(n) + ")");
      return static_cast<int32_t>(id);
    }
    for (const char* text : texts)
      if (const int32_t id = token_id(text); id >= 0) return id;
    return -1;
  };
  // llama.cpp's defaults: Llama-3 adds BOS, other byte-level vocabularies do not; the key decides.
  add_bos_ = gguf.get_bool_or("tokenizer.ggml.add_bos_token", pre == PreTokenizer::kLlama3);
  add_space_prefix_ = false;
  bos_ = id_of("tokenizer.ggml.bos_token_id", {"<|begin_of_text|>"});
  eos_ = id_of("tokenizer.ggml.eos_token_id", {"<|end_of_text|>", "<|endoftext|>"});
  unk_ = id_of("tokenizer.ggml.unknown_token_id", {});
  if (bos_ < 0 && add_bos_) fail("tokenizer.ggml.add_bos_token is true but there is no tokenizer.ggml.bos_token_id");
  if (eos_ < 0) fail("tokenizer.ggml.eos_token_id is missing (and no <|end_of_text|> or <|endoftext|> token)");
  // The most text one token covers: a normal token's bytes, a user-defined token's text.
  max_text_bytes_ = 1;
  for (size_t i = 0; i < n; ++i) {
    if (types_[i] == kNormal) max_text_bytes_ = std::max(max_text_bytes_, bpe_->piece_bytes[i].size());
    if (types_[i] == kUserDefined) max_text_bytes_ = std::max(max_text_bytes_, pieces_[i].size());
  }
}

void Tokenizer::finish_special_tokens(const GgufFile& gguf) {
  const size_t n = pieces_.size();
  for (size_t i = 0; i < n; ++i) {
    const int32_t type = types_[i];
    if ((type == kControl || type == kUserDefined || type == kUnknown) && !pieces_[i].empty())
      special_ids_.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(special_ids_.begin(), special_ids_.end(), [&](int32_t a, int32_t b) {
    return pieces_[static_cast<size_t>(a)].size() > pieces_[static_cast<size_t>(b)].size();
  });
  eot_ = eos_;
  if (gguf.has_key("tokenizer.ggml.eot_token_id")) {
    const uint32_t id = gguf.get_u32("tokenizer.ggml.eot_token_id");
    if (id >= n)
      throw std::runtime_error("tokenizer from GGUF '" + gguf.name() + "': tokenizer.ggml.eot_token_id = " +
                               std::to_string(id) + " is out of range (vocab " + std::to_string(n) + ")");
    eot_ = static_cast<int32_t>(id);
  } else {
    for (const char* text : {"<|eot_id|>", "<|im_end|>"})
      if (const int32_t id = token_id(text); id >= 0 && types_[static_cast<size_t>(id)] == kControl) {
        eot_ = id;
        break;
      }
  }
  eog_ids_ = {eos_, eot_};
  for (const char* text : {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end_of_text|>"})
    if (const int32_t id = token_id(text); id >= 0 && types_[static_cast<size_t>(id)] == kControl)
      eog_ids_.push_back(id);
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  return std::find(eog_ids_.begin(), eog_ids_.end(), id) != eog_ids_.end();
}

int32_t Tokenizer::token_id(std::string_view text) const {
  if (bpe_) {
    const auto it = bpe_->token_to_id.find(text);
    return it == bpe_->token_to_id.end() ? -1 : it->second;
  }
  const auto it = text_to_id_.find(text);
  return it == text_to_id_.end() ? -1 : it->second;
}

int32_t Tokenizer::token_type(int32_t id) const {
  (void)piece(id);  // range check
  return types_[static_cast<size_t>(id)];
}

std::string_view Tokenizer::trimmed_for_encode(std::string_view text) const {
  if (remove_extra_whitespaces_) {  // SentencePiece's remove_extra_whitespaces: no leading or trailing spaces
    while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
    while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  }
  return text;
}

size_t Tokenizer::min_tokens(std::string_view text) const {
  if (kind_ == Kind::kByteLevelBpe) return text.size() / max_text_bytes_;  // no normalization: bytes are text
  // Units of text as the pieces see them: a space or a literal "▁" is one, any other byte one.
  const bool squeeze = remove_extra_whitespaces_;  // as encode: runs of spaces as one
  text = trimmed_for_encode(text);
  size_t units = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text.compare(i, kSpace.size(), kSpace) == 0)
      i += kSpace.size() - 1;
    else if (squeeze && text[i] == ' ' && i > 0 && text[i - 1] == ' ')
      continue;
    ++units;
  }
  return units / max_text_bytes_;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  std::vector<int32_t> out;
  if (add_bos) {
    if (bos_ < 0) throw std::runtime_error("tokenizer: the vocabulary has no BOS token to add");
    out.push_back(bos_);
  }
  if (kind_ == Kind::kSentencePiece && !parse_special) {  // (user-defined pieces are the encoder's own)
    encode_spm(text, out);
    return out;
  }
  // Cut the special tokens out of the text, longest first, every occurrence left to right in what
  // is still text (llama.cpp's tokenizer_st_partition); then encode the text in between.
  struct Fragment {
    size_t begin, len;
    int32_t token;  // -1: text
  };
  std::vector<Fragment> frags, next;
  if (!text.empty()) frags.push_back({0, text.size(), -1});
  for (const int32_t id : special_ids_) {
    if (!parse_special && types_[static_cast<size_t>(id)] != kUserDefined) continue;
    const std::string& p = pieces_[static_cast<size_t>(id)];
    if (text.find(p) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& f : frags) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      const std::string_view area = text.substr(0, f.begin + f.len);
      size_t at = f.begin;
      for (size_t m; (m = area.find(p, at)) != std::string_view::npos; at = m + p.size()) {
        if (m > at) next.push_back({at, m - at, -1});
        next.push_back({m, p.size(), id});
      }
      if (at < area.size()) next.push_back({at, area.size() - at, -1});
    }
    frags.swap(next);
  }
  for (const Fragment& f : frags) {
    if (f.token >= 0)
      out.push_back(f.token);
    else if (bpe_)
      bpe_->encode(text.substr(f.begin, f.len), out);
    else
      encode_spm(text.substr(f.begin, f.len), out);
  }
  return out;
}

void Tokenizer::encode_spm(std::string_view text, std::vector<int32_t>& out) const {
  const bool squeeze = remove_extra_whitespaces_;
  text = trimmed_for_encode(text);
  if (text.empty()) return;

  std::string norm;
  norm.reserve(text.size() + text.size() / 2 + kSpace.size());
  if (add_space_prefix_) norm += kSpace;
  bool prev_space = false;
  for (char c : text) {
    if (c == ' ') {
      if (!(squeeze && prev_space)) norm += kSpace;
      prev_space = true;
    } else {
      norm += c;
      prev_space = false;
    }
  }

  // Initial symbols.
  std::vector<Symbol> sym;
  sym.reserve(norm.size());
  const auto* data = reinterpret_cast<const unsigned char*>(norm.data());
  for (size_t pos = 0; pos < norm.size();) {
    Symbol s;
    s.start = pos;
    if (user_first_byte_[data[pos]]) {
      const std::string_view rest(norm.data() + pos, norm.size() - pos);
      for (int32_t id : user_defined_) {  // longest first
        const std::string& p = pieces_[static_cast<size_t>(id)];
        if (rest.starts_with(p)) {
          s.len = p.size();
          s.frozen = true;
          break;
        }
      }
    }
    if (!s.frozen) s.len = utf8_len(data + pos, norm.size() - pos);
    s.prev = static_cast<int>(sym.size()) - 1;
    pos += s.len;
    s.next = pos < norm.size() ? static_cast<int>(sym.size()) + 1 : -1;
    sym.push_back(s);
  }

  std::priority_queue<Candidate, std::vector<Candidate>, CandidateOrder> agenda;
  // Pieces of type "unused" that a merge produced, mapped to the two pieces they came from.
  std::unordered_map<std::string_view, std::pair<std::string_view, std::string_view>> unused_split;
  auto view = [&](size_t start, size_t len) { return std::string_view(norm.data() + start, len); };
  auto try_pair = [&](int l, int r) {
    if (l < 0 || r < 0 || sym[l].frozen || sym[r].frozen) return;
    const std::string_view p = view(sym[l].start, sym[l].len + sym[r].len);
    const auto it = piece_to_id_.find(p);
    if (it == piece_to_id_.end()) return;
    agenda.push({scores_[static_cast<size_t>(it->second)], l, r, p.size()});
    if (types_[static_cast<size_t>(it->second)] == kUnused) {
      unused_split[p] = {view(sym[l].start, sym[l].len), view(sym[r].start, sym[r].len)};
    }
  };
  for (size_t i = 1; i < sym.size(); ++i) try_pair(static_cast<int>(i) - 1, static_cast<int>(i));

  while (!agenda.empty()) {
    const Candidate c = agenda.top();
    agenda.pop();
    Symbol& l = sym[c.left];
    Symbol& r = sym[c.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != c.size) continue;
    l.len += r.len;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = c.left;
    r.len = 0;
    try_pair(l.prev, c.left);
    try_pair(c.left, l.next);
  }

  auto emit_bytes = [&](std::string_view p) {
    for (unsigned char b : p) out.push_back(byte_ids_[b] >= 0 ? byte_ids_[b] : unk_);
  };
  // Unused pieces go back to their halves (recursively); unknown pieces to bytes.
  auto emit = [&](auto&& self, std::string_view p) -> void {
    const auto it = piece_to_id_.find(p);
    if (it == piece_to_id_.end()) return emit_bytes(p);
    if (types_[static_cast<size_t>(it->second)] == kUnused) {
      const auto sp = unused_split.find(p);
      if (sp != unused_split.end()) {
        self(self, sp->second.first);
        self(self, sp->second.second);
        return;
      }
    }
    out.push_back(it->second);
  };
  for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) emit(emit, view(sym[i].start, sym[i].len));
}

const std::string& Tokenizer::piece(int32_t id) const {
  if (id < 0 || id >= n_vocab())
    throw std::out_of_range("tokenizer: token id " + std::to_string(id) + " out of range (vocab " +
                            std::to_string(n_vocab()) + ")");
  return pieces_[static_cast<size_t>(id)];
}

std::string Tokenizer::token_to_piece(int32_t id) const {
  if (id < 0 || id >= n_vocab()) {
    throw std::runtime_error("tokenizer: token id " + std::to_string(id) + " out of range (vocab " +
                             std::to_string(n_vocab()) + ")");
  }
  const auto i = static_cast<size_t>(id);
  if (bpe_) {  // as llama.cpp's token_to_piece for byte-level vocabularies (control etc. render as "")
    if (types_[i] == kNormal) return bpe_->piece_bytes[i];
    if (types_[i] == kUserDefined) return pieces_[i];
    return "";
  }
  switch (types_[i]) {
    case kControl:
      return "";
    case kUnknown:
      return std::string(kUnkSurface);
    case kByte: {
      const int b = parse_byte_piece(pieces_[i]);
      if (b >= 0) return std::string(1, static_cast<char>(b));
      return pieces_[i];
    }
    default:
      return replace_space_symbol(pieces_[i]);
  }
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  bool at_start = add_space_prefix_;  // SentencePiece drops the dummy prefix's space once (false for BPE)
  for (int32_t id : ids) {
    std::string p = token_to_piece(id);
    if (p.empty()) continue;
    if (at_start && types_[static_cast<size_t>(id)] != kByte && p[0] == ' ') p.erase(0, 1);
    at_start = false;
    out += p;
  }
  return out;
}

}  // namespace locks
