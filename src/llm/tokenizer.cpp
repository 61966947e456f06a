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

#include "locks/gguf.h"

namespace locks {

namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";         // U+2581 "▁"
constexpr std::string_view kUnkSurface = " \xE2\x81\x87 ";  // SentencePiece's rendering of <unk>
enum TokenType : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

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
  if (model != "llama") fail("tokenizer.ggml.model is '" + model + "', only 'llama' (SentencePiece) is supported");

  Tokenizer t;
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
  return t;
}

std::string_view Tokenizer::trimmed_for_encode(std::string_view text) const {
  if (remove_extra_whitespaces_) {  // SentencePiece's remove_extra_whitespaces: no leading or trailing spaces
    while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
    while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  }
  return text;
}

size_t Tokenizer::min_tokens(std::string_view text) const {
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

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> out;
  if (add_bos) out.push_back(bos_);
  const bool squeeze = remove_extra_whitespaces_;
  text = trimmed_for_encode(text);
  if (text.empty()) return out;

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
  return out;
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
  bool at_start = add_space_prefix_;  // SentencePiece drops the dummy prefix's space once
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
