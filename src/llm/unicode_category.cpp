// Lookups in the generated category table: binary search over sorted ranges, a direct table for ASCII
// (most text, and every byte the regexes name).
#include "unicode_category.h"

#include <algorithm>
#include <array>

namespace locks {

namespace {

struct CategoryRange {
  uint32_t first, last;
  UnicodeCategory category;
};
struct WhiteSpaceRange {
  uint32_t first, last;
};

#include "unicode_categories.inc"

UnicodeCategory lookup(uint32_t cpt) {
  const auto* end = std::end(kCategoryRanges);
  const auto* it = std::upper_bound(std::begin(kCategoryRanges), end, cpt,
                                    [](uint32_t c, const CategoryRange& r) { return c < r.first; });
  if (it == std::begin(kCategoryRanges)) return UnicodeCategory::kOther;
  --it;
  return cpt <= it->last ? it->category : UnicodeCategory::kOther;
}

const std::array<UnicodeCategory, 128>& ascii_categories() {
  static const std::array<UnicodeCategory, 128> table = [] {
    std::array<UnicodeCategory, 128> t{};
    for (uint32_t c = 0; c < 128; ++c) t[c] = lookup(c);
    return t;
  }();
  return table;
}

}  // namespace

UnicodeCategory unicode_category(uint32_t cpt) { return cpt < 128 ? ascii_categories()[cpt] : lookup(cpt); }

bool unicode_is_white_space(uint32_t cpt) {
  if (cpt < 128) return (cpt >= 0x09 && cpt <= 0x0D) || cpt == 0x20;
  for (const WhiteSpaceRange& r : kWhiteSpaceRanges)
    if (cpt >= r.first && cpt <= r.last) return true;
  return false;
}

Utf8Unit utf8_decode(const unsigned char* p, size_t n) {
  const uint32_t c = p[0];
  if (c < 0x80) return {c, 1};
  const uint32_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
  if (len == 0 || len > n) return {0xFFFD, 1};
  uint32_t cpt = c & (0x7Fu >> len);
  for (uint32_t i = 1; i < len; ++i) {
    if ((p[i] & 0xC0) != 0x80) return {0xFFFD, 1};
    cpt = (cpt << 6) | (p[i] & 0x3Fu);
  }
  return {cpt, len};
}

}  // namespace locks
