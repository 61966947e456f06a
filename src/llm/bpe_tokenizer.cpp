// Byte-level BPE merges over token ids: every symbol of a word is a token (the 256 byte tokens to
// start with, and a merge's result is a token, checked at load), so a merge is one hash lookup of the
// pair of ids and the word's symbols are its tokens at the end.
#include "bpe_tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <queue>
#include <stdexcept>

#include "locks/gguf.h"
#include "unicode_category.h"

namespace locks {

namespace {

constexpr int32_t kNormal = 1;

std::string utf8_encode(uint32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (c >> 18));
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

// A symbol of the word being merged: a token over `len` bytes of the word; len 0 once merged away.
struct Symbol {
  int32_t id;
  uint32_t len;
  int prev, next;
};

// A pair that a merge applies to; `size` is the pair's byte length when queued, and a later mismatch
// means one side has merged since (the entry is stale).
struct Bigram {
  int32_t rank, result;
  int left, right;
  uint32_t size;
};

// Lowest rank first; among equal ranks the leftmost pair.
struct BigramOrder {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

}  // namespace

uint32_t gpt2_byte_to_cpt(uint8_t b) {
  const bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  if (self) return b;
  // The unprintable bytes, numbered in byte order, from U+0100.
  uint32_t k = 0;
  for (uint32_t x = 0; x < b; ++x) {
    const bool s = (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
    if (!s) ++k;
  }
  return 0x100 + k;
}

BpeModel BpeModel::build(const std::vector<std::string>& pieces, const std::vector<int32_t>& types,
                         const std::vector<std::string>& merge_list, PreTokenizer pre, const std::string& where) {
  auto fail = [&](const std::string& what) { throw std::runtime_error(where + what); };
  BpeModel m;
  m.pre = pre;
  m.ignore_merges = pre == PreTokenizer::kLlama3;
  const size_t n = pieces.size();
  m.token_to_id.reserve(n);
  for (size_t i = 0; i < n; ++i) m.token_to_id[pieces[i]] = static_cast<int32_t>(i);

  // Byte tokens, and the inverse map for decoding.
  int16_t cpt_to_byte[0x200];
  std::fill(std::begin(cpt_to_byte), std::end(cpt_to_byte), int16_t(-1));
  for (int b = 0; b < 256; ++b) {
    const uint32_t c = gpt2_byte_to_cpt(static_cast<uint8_t>(b));
    cpt_to_byte[c] = static_cast<int16_t>(b);
    m.byte_text[b] = utf8_encode(c);
    const auto it = m.token_to_id.find(m.byte_text[b]);
    if (it == m.token_to_id.end()) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", b);
      fail("tokenizer.ggml.tokens has no token " + gguf_quoted(m.byte_text[b]) + " for the byte " + hex +
           " (a byte-level BPE vocabulary holds all 256)");
    }
    m.byte_token[b] = it->second;
  }

  m.merges.reserve(merge_list.size());
  for (size_t i = 0; i < merge_list.size(); ++i) {
    const std::string& line = merge_list[i];
    auto bad = [&](const std::string& why) {
      fail("tokenizer.ggml.merges[" + std::to_string(i) + "] = " + gguf_quoted(line) + ": " + why);
    };
    const size_t sp = line.size() > 1 ? line.find(' ', 1) : std::string::npos;
    if (sp == std::string::npos || sp + 1 == line.size()) bad("not two pieces separated by a space");
    if (i > static_cast<size_t>(INT32_MAX)) fail("tokenizer.ggml.merges has more than 2^31 entries");
    const std::string_view left(line.data(), sp), right(line.data() + sp + 1, line.size() - sp - 1);
    const auto l = m.token_to_id.find(left), r = m.token_to_id.find(right);
    if (l == m.token_to_id.end()) bad(gguf_quoted(left) + " is not a token");
    if (r == m.token_to_id.end()) bad(gguf_quoted(right) + " is not a token");
    std::string joined(left);
    joined += right;
    const auto j = m.token_to_id.find(joined);
    if (j == m.token_to_id.end()) bad("the merged piece " + gguf_quoted(joined) + " is not a token");
    const uint64_t key = (uint64_t(uint32_t(l->second)) << 32) | uint32_t(r->second);
    m.merges.emplace(key, Merge{static_cast<int32_t>(i), j->second});  // a repeated pair keeps its first rank
  }

  // Normal tokens decode through the inverse map; a character outside it stays as its UTF-8 bytes.
  m.piece_bytes.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (types[i] != kNormal) continue;
    const std::string& p = pieces[i];
    const auto* s = reinterpret_cast<const unsigned char*>(p.data());
    std::string& out = m.piece_bytes[i];
    for (size_t at = 0; at < p.size();) {
      const Utf8Unit u = utf8_decode(s + at, p.size() - at);
      if (u.cpt < 0x200 && cpt_to_byte[u.cpt] >= 0)
        out += static_cast<char>(cpt_to_byte[u.cpt]);
      else
        out.append(p, at, u.len);
      at += u.len;
    }
  }
  return m;
}

void BpeModel::encode(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<size_t> ends;
  pretokenize(text, pre, ends);
  std::vector<Symbol> sym;
  std::vector<Bigram> heap_storage;
  std::priority_queue<Bigram, std::vector<Bigram>, BigramOrder> agenda(BigramOrder{}, std::move(heap_storage));
  std::string mapped;
  size_t begin = 0;
  for (const size_t end : ends) {
    const std::string_view word = text.substr(begin, end - begin);
    begin = end;
    if (ignore_merges && word.size() > 1) {
      mapped.clear();
      for (unsigned char b : word) mapped += byte_text[b];
      if (const auto it = token_to_id.find(mapped); it != token_to_id.end()) {
        out.push_back(it->second);
        continue;
      }
    }
    sym.clear();
    for (size_t i = 0; i < word.size(); ++i) {
      const int next = i + 1 < word.size() ? static_cast<int>(i) + 1 : -1;
      sym.push_back({byte_token[static_cast<unsigned char>(word[i])], 1, static_cast<int>(i) - 1, next});
    }
    auto try_pair = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      const auto it = merges.find((uint64_t(uint32_t(sym[l].id)) << 32) | uint32_t(sym[r].id));
      if (it != merges.end()) agenda.push({it->second.rank, it->second.result, l, r, sym[l].len + sym[r].len});
    };
    for (size_t i = 1; i < sym.size(); ++i) try_pair(static_cast<int>(i) - 1, static_cast<int>(i));
    while (!agenda.empty()) {
      const Bigram bg = agenda.top();
      agenda.pop();
      Symbol& l = sym[bg.left];
      Symbol& r = sym[bg.right];
      if (l.len == 0 || r.len == 0 || l.len + r.len != bg.size) continue;
      l.id = bg.result;
      l.len += r.len;
      l.next = r.next;
      if (r.next >= 0) sym[r.next].prev = bg.left;
      r.len = 0;
      try_pair(l.prev, bg.left);
      try_pair(bg.left, l.next);
    }
    for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
  }
}

}  // namespace locks
