// The pre-tokenizer regexes as a matcher over the text's characters. Each position tries the
// alternatives in the pattern's order; the first that matches gives the word (pretokenize.h).
#include "pretokenize.h"

#include <cstdint>
#include <stdexcept>

#include "locks/gguf.h"
#include "unicode_category.h"

namespace locks {

namespace {

// Character classes the pattern uses, one bit each.
enum : uint8_t { kL = 1, kN = 2, kWs = 4, kCrLf = 8 };

struct Chars {
  std::vector<uint32_t> cpt;  // code point (U+FFFD for a stray byte)
  std::vector<uint8_t> cls;   // kL | kN | kWs | kCrLf
  std::vector<uint8_t> len;   // its bytes (1 to 4)
};

uint8_t classify(uint32_t c) {
  if (c == '\r' || c == '\n') return kWs | kCrLf;
  if (unicode_is_white_space(c)) return kWs;
  const UnicodeCategory cat = unicode_category(c);
  return cat == UnicodeCategory::kLetter ? kL : cat == UnicodeCategory::kNumber ? kN : 0;
}

uint32_t ascii_lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

// The end (character index) of the word that starts at i < n.
size_t match_at(const Chars& t, size_t i, size_t n, size_t max_digits) {
  auto has = [&](size_t j, uint8_t bits) { return j < n && (t.cls[j] & bits) != 0; };
  // [^\s\p{L}\p{N}]: a character of none of those classes.
  auto other = [&](size_t j) { return j < n && (t.cls[j] & (kL | kN | kWs)) == 0; };
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)
  if (t.cpt[i] == '\'' && i + 1 < n) {
    const uint32_t c1 = ascii_lower(t.cpt[i + 1]);
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
    if (i + 2 < n) {
      const uint32_t c2 = ascii_lower(t.cpt[i + 2]);
      if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return i + 3;
    }
  }
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (has(i, kL) || (!has(i, kCrLf | kN) && has(i + 1, kL))) {
    size_t j = i + 1;
    while (has(j, kL)) ++j;
    return j;
  }
  // \p{N}{1,3} (llama-bpe) or \p{N} (qwen2)
  if (has(i, kN)) {
    size_t j = i + 1;
    while (j - i < max_digits && has(j, kN)) ++j;
    return j;
  }
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  if (other(i) || (t.cpt[i] == ' ' && other(i + 1))) {
    size_t j = i + 1;
    while (other(j)) ++j;
    while (has(j, kCrLf)) ++j;
    return j;
  }
  // \s*[\r\n]+ | \s+(?!\S) | \s+ over the run of white space starting here
  if (has(i, kWs)) {
    size_t end = i, last_crlf = SIZE_MAX;
    for (; has(end, kWs); ++end)
      if (t.cls[end] & kCrLf) last_crlf = end;
    if (last_crlf != SIZE_MAX) return last_crlf + 1;  // greedy \s* backs off to the last CR/LF
    if (end < n && end - i >= 2) return end - 1;      // leave one space to lead the next word
    return end;
  }
  return i + 1;  // (unreachable: every character is a letter, number, space or other)
}

}  // namespace

PreTokenizer pre_tokenizer_from_name(const std::string& name) {
  if (name == "llama-bpe") return PreTokenizer::kLlama3;
  if (name == "qwen2") return PreTokenizer::kQwen2;
  throw std::runtime_error("tokenizer.ggml.pre is " + gguf_quoted(name) +
                           ", a pre-tokenizer this tokenizer does not have (supported: 'llama-bpe', 'qwen2')");
}

void pretokenize(std::string_view text, PreTokenizer kind, std::vector<size_t>& ends) {
  Chars t;
  t.cpt.reserve(text.size());
  t.cls.reserve(text.size());
  t.len.reserve(text.size());
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t at = 0; at < text.size();) {
    const Utf8Unit u = utf8_decode(p + at, text.size() - at);
    t.cpt.push_back(u.cpt);
    t.cls.push_back(classify(u.cpt));
    t.len.push_back(static_cast<uint8_t>(u.len));
    at += u.len;
  }
  const size_t n = t.cpt.size();
  const size_t max_digits = kind == PreTokenizer::kLlama3 ? 3 : 1;
  size_t byte = 0;
  for (size_t i = 0; i < n;) {
    const size_t end = match_at(t, i, n, max_digits);
    for (; i < end; ++i) byte += t.len[i];
    ends.push_back(byte);
  }
}

}  // namespace locks
