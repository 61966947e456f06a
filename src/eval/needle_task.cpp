// Needle tasks from real held-out text, tokenized as one string so the needle and question tokens
// are exactly those the reference model was trained on.
#include "locks/needle_task.h"

#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <sstream>
#include <stdexcept>

namespace locks {

namespace {

// Lowercase English words of 4-9 letters for needle keys.
constexpr const char* kKeyWords[] = {
    "apple",   "harbor",  "violet", "marble",  "canyon",  "falcon", "garden",  "silver",  "thunder", "meadow",
    "lantern", "orbit",   "pepper", "quartz",  "river",   "saddle", "timber",  "velvet",  "walnut",  "yellow",
    "anchor",  "bridge",  "candle", "dragon",  "ember",   "forest", "glacier", "hollow",  "island",  "jungle",
    "kettle",  "ladder",  "mirror", "needle",  "oyster",  "pillow", "rocket",  "shadow",  "tunnel",  "umbrella",
    "valley",  "window",  "basket", "cobalt",  "desert",  "engine", "feather", "galaxy",  "helmet",  "insect",
    "jacket",  "kitten",  "lemon",  "magnet",  "nectar",  "olive",  "parrot",  "rabbit",  "sunset",  "tiger",
    "copper",  "dolphin", "eagle",  "fabric",  "guitar",  "hammer", "ivory",   "jasmine", "kingdom", "lotus",
    "maple",   "nickel",  "ocean",  "planet",  "quiver",  "raven",  "spider",  "tomato",  "urchin",  "vessel",
    "wizard",  "zebra",   "acorn",  "blossom", "crystal", "dusk",   "elbow",   "fossil",  "granite", "horizon",
    "igloo",   "juniper", "koala",  "lagoon",  "mango",   "nutmeg", "onion",   "pebble",  "radish",  "spruce"};

size_t total_bytes(const std::vector<std::string>& docs) {
  size_t n = 0;
  for (const auto& d : docs) n += d.size();
  return n;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::string line;
  std::istringstream in(s);
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

std::string join_lines(const std::vector<std::string>& lines, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    if (i) s += '\n';
    s += lines[i];
  }
  return s;
}

bool is_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return a.size() <= b.size() && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace

std::string needle_family_name(NeedleFamily f) {
  switch (f) {
    case NeedleFamily::kSingle:
      return "single";
    case NeedleFamily::kMultiKey:
      return "multikey";
    case NeedleFamily::kMultiQuery:
      return "multiquery";
  }
  return "?";
}

NeedleFamily parse_needle_family(const std::string& s) {
  if (s == "single") return NeedleFamily::kSingle;
  if (s == "multikey") return NeedleFamily::kMultiKey;
  if (s == "multiquery") return NeedleFamily::kMultiQuery;
  throw std::invalid_argument(
      fmt::format("unknown task family '{}' (expected single, multikey, multiquery or continuation)", s));
}

int NeedleTask::total_tokens() const {
  size_t n = context_ids.size();
  for (const auto& q : questions) n += q.prompt_ids.size() + q.answer_ids.size();
  return int(n);
}

NeedleTask make_needle_task(const std::vector<std::string>& docs, const Tokenizer& tok, NeedleFamily family,
                            int target_tokens, uint64_t seed) {
  if (target_tokens < 256)
    throw std::invalid_argument(fmt::format("needle task of {} tokens: need >= 256", target_tokens));
  if (docs.empty()) throw std::invalid_argument("needle task: no documents");
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 12345);
  NeedleTask task;
  task.family = family;
  task.target_tokens = target_tokens;

  // Needles: distinct keys, 7-digit values (leading zeros kept).
  const int n_needles = family == NeedleFamily::kSingle ? 1 : 4;
  const size_t n_words = std::size(kKeyWords);
  while (int(task.keys.size()) < n_needles) {
    std::string k = kKeyWords[rng() % n_words];
    if (std::find(task.keys.begin(), task.keys.end(), k) == task.keys.end()) task.keys.push_back(k);
  }
  for (int i = 0; i < n_needles; ++i) task.values.push_back(fmt::format("{:07d}", int(rng() % 10000000)));
  std::vector<int> asked = {0};
  if (family == NeedleFamily::kMultiKey) asked = {int(rng() % 4)};
  if (family == NeedleFamily::kMultiQuery) {
    asked = {int(rng() % 4)};
    int second;
    do second = int(rng() % 4);
    while (second == asked[0]);
    asked.push_back(second);
  }

  // Haystack lines: whole documents from a seeded start, until comfortably more than needed
  // (this text runs ~2.5 bytes per token).
  std::vector<std::string> lines;
  size_t chars = 0;
  const size_t want_chars = size_t(target_tokens) * 4 + 4096;
  for (size_t d = rng() % docs.size(), seen = 0; chars < want_chars; d = (d + 1) % docs.size(), ++seen) {
    if (seen > docs.size())
      throw std::invalid_argument(
          fmt::format("needle task: the corpus holds {} bytes of text, fewer than the {} a {}-token haystack needs",
                      total_bytes(docs), want_chars, target_tokens));
    for (auto& l : split_lines(docs[d])) {
      chars += l.size() + 1;
      lines.push_back(std::move(l));
    }
    lines.emplace_back();  // blank line between documents
  }

  std::vector<std::string> q_text, a_text;
  for (size_t i = 0; i < asked.size(); ++i) {
    const std::string& k = task.keys[asked[i]];
    q_text.push_back(fmt::format("{}\nQuestion: what is the magic number for {}? Answer: the magic number for {} is",
                                 i == 0 ? "" : ".", k, k));
    a_text.push_back(" " + task.values[asked[i]]);
  }
  std::vector<double> depth(n_needles);
  for (int i = 0; i < n_needles; ++i) {
    const double jitter = (double(rng() % 1000) / 1000.0 - 0.5) * 0.6 / n_needles;
    depth[i] = std::clamp((i + 0.5) / n_needles + jitter, 0.02, 0.98);
  }

  // Largest haystack prefix whose full task fits the target (binary search over line counts).
  auto build = [&](size_t n_lines, std::string* ctx_out) {
    std::vector<std::string> l(lines.begin(), lines.begin() + n_lines);
    for (int i = n_needles - 1; i >= 0; --i) {
      const size_t at = std::max<size_t>(1, size_t(depth[i] * double(n_lines)));  // always after a "\n"
      l.insert(l.begin() + at, fmt::format("Remember: the magic number for {} is {}.", task.keys[i], task.values[i]));
    }
    std::string ctx = join_lines(l, l.size());
    std::string full = ctx;
    for (size_t i = 0; i < q_text.size(); ++i) full += q_text[i] + a_text[i];
    if (ctx_out) *ctx_out = ctx;
    return full;
  };
  size_t lo = 1, hi = lines.size();
  while (lo < hi) {
    const size_t mid = (lo + hi + 1) / 2;
    if (int(tok.encode(build(mid, nullptr), tok.add_bos()).size()) <= target_tokens)
      lo = mid;
    else
      hi = mid - 1;
  }
  std::string ctx;
  build(lo, &ctx);

  // Token segments by prefix tokenization; "\n" is an atomic token and answers start at a space,
  // so every prefix tokenizes to a prefix of the whole (checked).
  task.context_ids = tok.encode(ctx, tok.add_bos());
  std::string text = ctx;
  std::vector<int32_t> prev = task.context_ids;
  for (size_t i = 0; i < q_text.size(); ++i) {
    NeedleQuestion q;
    q.needle = asked[i];
    q.key = task.keys[asked[i]];
    q.value = task.values[asked[i]];
    text += q_text[i];
    std::vector<int32_t> with_q = tok.encode(text, tok.add_bos());
    text += a_text[i];
    std::vector<int32_t> with_a = tok.encode(text, tok.add_bos());
    if (!is_prefix(prev, with_q) || !is_prefix(with_q, with_a))
      throw std::runtime_error("needle task: tokenization of the question is not prefix-stable");
    q.prompt_ids.assign(with_q.begin() + prev.size(), with_q.end());
    q.answer_ids.assign(with_a.begin() + with_q.size(), with_a.end());
    task.questions.push_back(std::move(q));
    prev = std::move(with_a);
  }
  // Needle token positions (carrier pages): tokens of the context before each needle's line.
  for (int i = 0; i < n_needles; ++i) {
    const size_t at = ctx.find(fmt::format("\nRemember: the magic number for {} is", task.keys[i]));
    if (at == std::string::npos) throw std::runtime_error("needle task: needle lost while building the context");
    task.needle_pos.push_back(int32_t(tok.encode(ctx.substr(0, at + 1), tok.add_bos()).size()));
    task.needle_depths.push_back(double(task.needle_pos.back()) / double(task.context_ids.size()));
    const size_t at_value = ctx.find(" " + task.values[i] + ".", at + 1);
    task.value_pos.push_back(int32_t(tok.encode(ctx.substr(0, at_value), tok.add_bos()).size()));
  }
  return task;
}

std::vector<int32_t> make_text_tokens(const std::vector<std::string>& docs, const Tokenizer& tok, int n_tokens,
                                      uint64_t seed) {
  if (docs.empty() || n_tokens < 2) throw std::invalid_argument("text tokens: no documents or too few tokens");
  std::mt19937_64 rng(seed * 0xD1B54A32D192ED03ull + 99);
  std::string text;
  const size_t want_bytes = size_t(n_tokens) * 4 + 4096;
  size_t d = rng() % docs.size();
  for (size_t seen = 0; text.size() < want_bytes; d = (d + 1) % docs.size(), ++seen) {
    if (seen > docs.size())
      throw std::invalid_argument(
          fmt::format("text tokens: the corpus holds {} bytes of text, fewer than the {} that {} tokens need",
                      total_bytes(docs), want_bytes, n_tokens));
    text += docs[d];
    text += "\n\n";
  }
  std::vector<int32_t> ids = tok.encode(text, tok.add_bos());
  if (int(ids.size()) < n_tokens)
    throw std::invalid_argument(
        fmt::format("text tokens: the corpus's text makes {} tokens, fewer than the {} needed", ids.size(), n_tokens));
  ids.resize(size_t(n_tokens));
  return ids;
}

}  // namespace locks
