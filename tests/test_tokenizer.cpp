// Tokenizer: must reproduce the SentencePiece library's ids (tokenizer-vectors.json) for both
// vocabularies, llama2.c's prompt encodings for stories260K, and round-trip through decode().
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "locks/gguf.h"
#include "locks/tokenizer.h"
#include "test_paths.h"
#include "test_util.h"

namespace locks {
namespace {

using ::testing::HasSubstr;

nlohmann::json load_json(const std::string& rel) {
  std::ifstream in(test::shared_path(rel));
  return nlohmann::json::parse(in);
}

class TokenizerModels : public ::testing::TestWithParam<std::pair<std::string, std::string>> {
 protected:
  void SetUp() override {
    if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
    gguf_ = std::make_unique<GgufFile>(GgufFile::open(test::shared_path("models/" + GetParam().second)));
    tok_ = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*gguf_));
  }
  nlohmann::json cases() const { return load_json("models/tokenizer-vectors.json")["cases"][GetParam().first]; }
  // What decode(encode(text)) gives: stories260K's SentencePiece model removes extra whitespace
  // (leading/trailing spaces, runs of spaces); locks-ref keeps every space.
  std::string expected_round_trip(std::string_view text) const {
    if (GetParam().first == "locks-ref") return std::string(text);
    std::string out;
    for (char c : text) {
      if (c == ' ' && (out.empty() || out.back() == ' ')) continue;
      out += c;
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out;
  }
  std::unique_ptr<GgufFile> gguf_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_P(TokenizerModels, MatchesSentencePieceVectors) {
  const auto cs = cases();
  ASSERT_GE(cs.size(), 10u);
  for (const auto& c : cs) {
    const std::string text = c["text"];
    SCOPED_TRACE("text: \"" + text + "\"");
    EXPECT_EQ(tok_->encode(text, false), c["ids"].get<std::vector<int32_t>>());
  }
}

TEST_P(TokenizerModels, RoundTrips) {
  for (const auto& c : cases()) {
    const std::string text = c["text"];
    SCOPED_TRACE("text: \"" + text + "\"");
    EXPECT_EQ(tok_->decode(tok_->encode(text, false)), expected_round_trip(text));
    // BOS/EOS decode to nothing.
    auto ids = tok_->encode(text, true);
    EXPECT_EQ(ids.front(), tok_->bos());
    ids.push_back(tok_->eos());
    EXPECT_EQ(tok_->decode(ids), expected_round_trip(text));
  }
  // Invalid UTF-8 goes through byte fallback and comes back unchanged.
  const std::string bad = "a\xff\xfe b\xc3(\xe2\x82 \xf0\x9f";
  EXPECT_EQ(tok_->decode(tok_->encode(bad, false)), bad);
  EXPECT_EQ(tok_->encode("", true), (std::vector<int32_t>{tok_->bos()}));
}

TEST_P(TokenizerModels, PiecesAndSpecialIds) {
  EXPECT_EQ(tok_->bos(), 1);
  EXPECT_EQ(tok_->eos(), 2);
  EXPECT_EQ(tok_->unk(), 0);
  EXPECT_TRUE(tok_->add_bos());
  EXPECT_EQ(tok_->token_to_piece(tok_->bos()), "");
  EXPECT_EQ(tok_->piece(1), "<s>");
  // "<0x41>" renders as the byte 'A'.
  for (int32_t id = 0; id < tok_->n_vocab(); ++id) {
    if (tok_->piece(id) == "<0x41>") {
      EXPECT_EQ(tok_->token_to_piece(id), "A");
    }
    if (tok_->piece(id) == "\xE2\x96\x81") {
      EXPECT_EQ(tok_->token_to_piece(id), " ");
    }
  }
  EXPECT_THROW(tok_->token_to_piece(tok_->n_vocab()), std::runtime_error);
  EXPECT_EQ(test::error_of<std::out_of_range>([&] { (void)tok_->piece(-1); }),
            "tokenizer: token id -1 out of range (vocab " + std::to_string(tok_->n_vocab()) + ")");
  const std::vector<int32_t> bad_ids{5, -1};
  EXPECT_THROW(tok_->decode(bad_ids), std::runtime_error);
}

// ~70 KB of text must encode quickly (the merge loop is a priority queue, not rescans).
TEST_P(TokenizerModels, EncodesLargeTextFast) {
  std::string text;
  const auto cs = cases();
  while (text.size() < 70000) {
    for (const auto& c : cs) text += c["text"].get<std::string>() + " ";
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok_->encode(text, false);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 0.5);
  EXPECT_GT(ids.size(), 10000u);
  EXPECT_EQ(tok_->decode(ids), expected_round_trip(text));
  // 70 KB of one repeated character is the worst case for stale agenda entries.
  const std::string same(70000, 'a');
  EXPECT_EQ(tok_->decode(tok_->encode(same, false)), same);
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, TokenizerModels,
                         ::testing::Values(std::pair<std::string, std::string>{"locks-ref", "locks-ref-a-q8_0.gguf"},
                                           std::pair<std::string, std::string>{"stories260K", "stories260K-f32.gguf"}),
                         [](const auto& p) { return p.param.first == "locks-ref" ? "LocksRef" : "Stories260K"; });

TEST(TokenizerStories, PromptEncodingsWithBos) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const GgufFile f = GgufFile::open(test::shared_path("models/stories260K-f32.gguf"));
  const Tokenizer tok = Tokenizer::from_gguf(f);
  const auto ref = load_json("models/stories260K.reference.json");
  ASSERT_FALSE(ref["prompt_encodings"].empty());
  for (const auto& p : ref["prompt_encodings"]) {
    const std::string text = p["text"];
    SCOPED_TRACE(text);
    EXPECT_EQ(tok.encode(text, true), p["ids_with_bos"].get<std::vector<int32_t>>());
  }
}

TEST(TokenizerLocksRef, UserDefinedAndWhitespace) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const GgufFile f = GgufFile::open(test::shared_path("models/locks-ref-a-q8_0.gguf"));
  const Tokenizer tok = Tokenizer::from_gguf(f);
  // "\n" is user-defined (id 3): atomic, after the once-only "▁" prefix.
  EXPECT_EQ(tok.encode("\n", false), (std::vector<int32_t>{1656, 3}));
  EXPECT_EQ(tok.encode("\n\n\t", false), (std::vector<int32_t>{1656, 3, 3, 4}));
  EXPECT_EQ(tok.encode(" ", false), (std::vector<int32_t>{261}));  // "▁▁"
  // The needle answer format: "▁" then one token per digit.
  const auto ids = tok.encode("is 0012345.", false);
  EXPECT_EQ(tok.decode(ids), "is 0012345.");
  // Control tokens in the text: text unless parse_special; then the token, and the text on either
  // side encoded as a prompt of its own (llama.cpp: a space prefix after every special token).
  const auto plain = tok.encode("ab</s>cd", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), tok.eos()), 0);
  std::vector<int32_t> want = tok.encode("ab", false);
  want.push_back(tok.eos());
  for (int32_t id : tok.encode("cd", false)) want.push_back(id);
  EXPECT_EQ(tok.encode("ab</s>cd", false, true), want);
  EXPECT_EQ(tok.token_id("</s>"), tok.eos());
  EXPECT_EQ(tok.eot(), tok.eos());  // no end-of-turn token of its own
  EXPECT_TRUE(tok.is_end_of_generation(tok.eos()));
  EXPECT_EQ(tok.kind(), Tokenizer::Kind::kSentencePiece);
}

// ---- vocabularies written here: validation errors and the merge rules in isolation ----

struct MiniVocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  std::string model = "llama";
  int remove_extra_ws = -1;  // written as tokenizer.ggml.remove_extra_whitespaces when >= 0
};

std::vector<uint8_t> write_vocab(const MiniVocab& v) {
  std::vector<uint8_t> b;
  auto raw = [&](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) b.push_back(static_cast<const uint8_t*>(p)[i]);
  };
  auto u32 = [&](uint32_t x) {
    for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(x >> (8 * i)));
  };
  auto u64 = [&](uint64_t x) {
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(x >> (8 * i)));
  };
  auto str = [&](std::string_view s) {
    u64(s.size());
    raw(s.data(), s.size());
  };
  raw("GGUF", 4);
  u32(3);
  u64(0);
  u64(v.remove_extra_ws >= 0 ? 5 : 4);
  if (v.remove_extra_ws >= 0) {
    str("tokenizer.ggml.remove_extra_whitespaces");
    u32(7);
    b.push_back(static_cast<uint8_t>(v.remove_extra_ws));
  }
  str("tokenizer.ggml.model");
  u32(8);
  str(v.model);
  str("tokenizer.ggml.tokens");
  u32(9);
  u32(8);
  u64(v.tokens.size());
  for (const auto& t : v.tokens) str(t);
  str("tokenizer.ggml.scores");
  u32(9);
  u32(6);
  u64(v.scores.size());
  for (float s : v.scores) u32(std::bit_cast<uint32_t>(s));
  str("tokenizer.ggml.token_type");
  u32(9);
  u32(5);
  u64(v.types.size());
  for (int32_t t : v.types) u32(static_cast<uint32_t>(t));
  return b;
}

// <unk> <s> </s>, 256 byte tokens, then the given normal pieces (scores descending with order).
MiniVocab mini(std::vector<std::string> pieces, std::vector<int32_t> extra_types = {}) {
  MiniVocab v;
  v.tokens = {"<unk>", "<s>", "</s>"};
  v.types = {2, 3, 3};
  for (int i = 0; i < 256; ++i) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", i);
    v.tokens.push_back(buf);
    v.types.push_back(6);
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    v.tokens.push_back(pieces[i]);
    v.types.push_back(i < extra_types.size() && extra_types[i] ? extra_types[i] : 1);
  }
  v.scores.assign(v.tokens.size(), 0.0f);
  for (size_t i = 0; i < pieces.size(); ++i) v.scores[259 + i] = -static_cast<float>(i);
  return v;
}

Tokenizer make(const MiniVocab& v) {
  const GgufFile f = GgufFile::from_bytes(write_vocab(v), "vocab");
  return Tokenizer::from_gguf(f);
}

std::string from_gguf_error(const MiniVocab& v) {
  try {
    make(v);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "no exception";
}

TEST(TokenizerMini, ValidationErrors) {
  MiniVocab v = mini({"a"});
  v.model = "bert";
  EXPECT_THAT(from_gguf_error(v), HasSubstr("tokenizer.ggml.model is 'bert', not one this tokenizer reads"));
  v = mini({"a"});
  v.scores.pop_back();
  EXPECT_THAT(from_gguf_error(v), HasSubstr("tokenizer.ggml.scores has 259 entries, tokens has 260"));
  v = mini({"a"});
  v.types.push_back(1);
  EXPECT_THAT(from_gguf_error(v), HasSubstr("tokenizer.ggml.token_type has 261 entries"));
  v = mini({"a"});
  v.scores[259] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(from_gguf_error(v), HasSubstr("tokenizer.ggml.scores[259] is NaN"));
  for (int32_t bad_type : {0, 7, 99, -1}) {
    v = mini({"a"});
    v.types[259] = bad_type;
    EXPECT_THAT(from_gguf_error(v), HasSubstr("tokenizer.ggml.token_type[259] = " + std::to_string(bad_type) +
                                              " is not a token type (1 normal .. 6 byte)"));
  }
  const GgufFile empty =
      GgufFile::from_bytes({'G', 'G', 'U', 'F', 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, "empty");
  try {
    Tokenizer::from_gguf(empty);
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tokenizer.ggml.model"));
  }
}

// min_tokens is a lower bound on the token count (what `locks run` uses to refuse a prompt far beyond
// the context before tokenizing it): a piece's "▁" covers one space; the whitespace squeeze of a
// vocabulary without "▁▁" (this one) drops leading, trailing and repeated spaces.
TEST(TokenizerMini, MinTokensIsALowerBound) {
  const std::string S = "\xE2\x96\x81";  // ▁
  const Tokenizer t = make(mini({S + "abcdefgh", "abcdefgh", "abcd", "ab", S, "a", "b", "c", "d", "e", "f", "g", "h"}));
  EXPECT_EQ(t.min_tokens(std::string(90, 'a')), 10u);   // the most text one token covers: ▁abcdefgh, 9 bytes
  EXPECT_EQ(t.min_tokens(std::string(5000, ' ')), 0u);  // squeezed away: BOS only
  EXPECT_EQ(t.min_tokens("ab" + std::string(300, ' ') + "cd"), 0u);
  const std::vector<std::string> texts = {"abcdefgh abcdefgh  abcdefgh",
                                          "  ha ha ab\xC3\xA9"
                                          "cd  ",
                                          S + S + S + S + S, "\xF0\x9F\x98\x80\xF0\x9F\x98\x80\xFF\xFE",
                                          std::string(900, 'a')};
  for (const std::string& text : texts) EXPECT_LE(t.min_tokens(text), t.encode(text, false).size()) << text;
}

// The same bound on the real vocabularies, over texts built to be hard for it: runs of spaces (squeezed
// by stories260K), literal "▁" runs (locks-ref has pieces of sixteen), byte fallback, long words.
TEST_P(TokenizerModels, MinTokensIsALowerBound) {
  const std::string S = "\xE2\x96\x81";
  std::vector<std::string> texts = {std::string(20000, ' '), "Once upon a time" + std::string(20000, ' ') + "there was",
                                    std::string("\xFF\xFE\xFD\x80") + std::string(64, 'x')};
  std::string lit;
  for (int i = 0; i < 1600; ++i) lit += S;
  texts.push_back(lit);
  std::string mixed;
  for (const auto& c : cases()) mixed += c["text"].get<std::string>() + "   ";
  texts.push_back(mixed);
  for (const std::string& text : texts) {
    const size_t bound = tok_->min_tokens(text), n = tok_->encode(text, false).size();
    EXPECT_LE(bound, n) << text.substr(0, 40);
  }
  // Not vacuous: a long ordinary text gets a bound within a factor 16 (locks-ref has pieces of ~30
  // bytes; ordinary words take ~4 per token).
  EXPECT_GT(tok_->min_tokens(mixed) * 16, tok_->encode(mixed, false).size()) << mixed.substr(0, 40);
}

TEST(TokenizerMini, MergeOrderAndTies) {
  const std::string S = "\xE2\x96\x81";  // ▁
  // Higher score wins: "bc" (score -0) before "ab" (-1) leaves a + bc.
  {
    const Tokenizer t = make(mini({"bc", "ab", S, "a", "b", "c"}));
    EXPECT_EQ(t.encode("abc", false), (std::vector<int32_t>{261, 262, 259}));  // ▁ a bc
  }
  // Equal pairs: the leftmost merges first, so "aaa" -> aa + a.
  {
    const Tokenizer t = make(mini({"aa", S, "a"}));
    EXPECT_EQ(t.encode("aaa", false), (std::vector<int32_t>{260, 259, 261}));
  }
  // Unknown characters fall back to bytes; an absent byte token falls back to <unk>.
  {
    MiniVocab v = mini({S});
    const Tokenizer t = make(v);
    EXPECT_EQ(t.encode("\xC3\xA9", false), (std::vector<int32_t>{259, 3 + 0xC3, 3 + 0xA9}));
    v.tokens[3 + 0xA9] = "<0xZZ>";
    const Tokenizer t2 = make(v);
    EXPECT_EQ(t2.encode("\xC3\xA9", false), (std::vector<int32_t>{259, 3 + 0xC3, 0}));
  }
  // User-defined pieces are atomic (longest match) and never merge with neighbours.
  {
    const Tokenizer t = make(mini({"<tag>", "<t", S, "<", "t", "a", "g", ">", S + "<"}, {4}));
    EXPECT_EQ(t.encode("<tag><ta", false), (std::vector<int32_t>{261, 259, 260, 264}));
    EXPECT_EQ(t.decode(t.encode("<tag><ta", false)), "<tag><ta");
  }
  // Extra whitespace: collapsed unless the vocabulary has a "▁▁" piece or the key says otherwise.
  {
    const Tokenizer squeeze = make(mini({S, "a"}));
    EXPECT_EQ(squeeze.encode("  a   a ", false), squeeze.encode("a a", false));
    const Tokenizer keep = make(mini({S + S, S, "a"}));
    EXPECT_EQ(keep.encode("a  a", false), (std::vector<int32_t>{260, 261, 259, 261}));
    MiniVocab v = mini({S, "a"});
    v.remove_extra_ws = 0;
    const Tokenizer keyed = make(v);
    EXPECT_EQ(keyed.encode("a  a", false), (std::vector<int32_t>{259, 260, 259, 259, 260}));
  }
  // An "unused" piece formed by a merge is split back into the pair that formed it.
  {
    const Tokenizer t = make(mini({"ab", S, "a", "b"}, {5}));
    EXPECT_EQ(t.encode("ab", false), (std::vector<int32_t>{260, 261, 262}));
  }
}

}  // namespace
}  // namespace locks
