// Byte-level BPE (tokenizer.ggml.model = gpt2): llama.cpp's tokenizer test vectors for the real
// Llama-3 and Qwen2 vocabularies reproduced exactly, llama.cpp's prompt ids of the tiny models,
// special tokens, round trips, speed, the pre-tokenizer's regex semantics and hostile vocabularies.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <lzma.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "family_vocab.h"
#include "llm/pretokenize.h"
#include "locks/gguf.h"
#include "locks/text_corpus.h"
#include "locks/tokenizer.h"
#include "test_paths.h"

namespace locks {
namespace {

using ::testing::HasSubstr;

// Time limits stretch under the sanitizers (CI runs every test under ASan + UBSan).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr double kSanitizerSlowdown = 20.0;
#else
constexpr double kSanitizerSlowdown = 1.0;
#endif

struct Vectors {
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
};

// .inp: strings separated by "\n__ggml_vocab_test__\n" (one after the last); .out: a line of ids each.
Vectors load_vectors(const std::string& pre) {
  const std::string base = test::shared_path("models/families/tokenizer-" + pre);
  const std::vector<uint8_t> inp = read_bytes(base + ".inp");
  const std::string all(inp.begin(), inp.end()), sep = "\n__ggml_vocab_test__\n";
  Vectors v;
  for (size_t at = 0, next; (next = all.find(sep, at)) != std::string::npos; at = next + sep.size())
    v.texts.push_back(all.substr(at, next - at));
  std::ifstream out(base + ".out");
  for (std::string line; std::getline(out, line);) {
    std::istringstream ss(line);
    v.ids.emplace_back(std::istream_iterator<int32_t>(ss), std::istream_iterator<int32_t>());
  }
  return v;
}

class BpeFamilies : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  }
};

TEST_P(BpeFamilies, ReproducesLlamaCppVectors) {
  const Tokenizer& tok = family_vocab(GetParam());
  const Vectors v = load_vectors(GetParam());
  ASSERT_EQ(v.texts.size(), v.ids.size());
  ASSERT_GE(v.texts.size(), 40u);
  for (size_t i = 0; i < v.texts.size(); ++i) {
    SCOPED_TRACE("string " + std::to_string(i) + ": \"" + v.texts[i] + "\"");
    const std::vector<int32_t> ids = tok.encode(v.texts[i], false);
    EXPECT_EQ(ids, v.ids[i]);
    EXPECT_EQ(tok.decode(ids), v.texts[i]);
  }
}

TEST_P(BpeFamilies, SpecialTokensAndIds) {
  const Tokenizer& tok = family_vocab(GetParam());
  EXPECT_EQ(tok.kind(), Tokenizer::Kind::kByteLevelBpe);
  EXPECT_EQ(tok.pre(), GetParam());
  const bool llama = GetParam() == "llama-bpe";
  // The files' keys (../shared/MODELS.md): Llama-3 adds BOS 128000, Qwen adds none.
  EXPECT_EQ(tok.add_bos(), llama);
  EXPECT_EQ(tok.bos(), llama ? 128000 : 151643);
  EXPECT_EQ(tok.eos(), llama ? 128009 : 151645);
  const std::string start = llama ? "<|begin_of_text|>" : "<|im_start|>";
  const std::string end = llama ? "<|eot_id|>" : "<|im_end|>";
  EXPECT_EQ(tok.token_id(start), llama ? 128000 : 151644);
  EXPECT_EQ(tok.eot(), llama ? 128009 : 151645);
  EXPECT_EQ(tok.token_id("no such token"), -1);
  EXPECT_TRUE(tok.is_end_of_generation(tok.eot()));
  EXPECT_TRUE(tok.is_end_of_generation(tok.token_id(llama ? "<|end_of_text|>" : "<|endoftext|>")));
  EXPECT_FALSE(tok.is_end_of_generation(tok.token_id(start)));
  // Control tokens are text unless asked for; then they are single tokens, the rest as before.
  const std::string text = start + "user\nHi there" + end;
  const auto plain = tok.encode(text, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), tok.token_id(start)), 0);
  EXPECT_EQ(tok.decode(plain), text);
  const auto special = tok.encode(text, false, true);
  std::vector<int32_t> want{tok.token_id(start)};
  for (int32_t id : tok.encode("user\nHi there", false)) want.push_back(id);
  want.push_back(tok.token_id(end));
  EXPECT_EQ(special, want);
  EXPECT_EQ(tok.token_to_piece(tok.token_id(end)), "");  // control tokens render as nothing
  EXPECT_EQ(tok.piece(tok.token_id(end)), end);
  // With BOS: prepended once.
  if (llama) {
    EXPECT_EQ(tok.encode("Hi", true).front(), 128000);
  }
}

TEST_P(BpeFamilies, RoundTripsAnyBytesAndEncodesOneMegabyteFast) {
  const Tokenizer& tok = family_vocab(GetParam());
  // Invalid UTF-8 (stray continuation bytes, truncated sequences, 0xFF) keeps its bytes.
  const std::string bad = "a\xff\xfe b\xc3(\xe2\x82 \xf0\x9f \x80\x80x\xc3";
  EXPECT_EQ(tok.decode(tok.encode(bad, false)), bad);
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes += static_cast<char>(b);
  EXPECT_EQ(tok.decode(tok.encode(all_bytes + all_bytes, false)), all_bytes + all_bytes);
  EXPECT_EQ(tok.encode("", false), std::vector<int32_t>{});
  // 1 MB of real held-out text (kernel docs, C, Python) plus long runs: the eval harness's load.
  std::string text;
  for (const std::string& doc : load_documents(test::shared_path("data/heldout-text.txt.xz"))) {
    text += doc;
    if (text.size() > (1u << 20)) break;
  }
  text += std::string(20000, ' ') + std::string(20000, 'a') + std::string(20000, '7') + "\n";
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok.encode(text, false);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 1.0 * kSanitizerSlowdown) << text.size() << " bytes";
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_LE(tok.min_tokens(text), ids.size());
  EXPECT_GT(tok.min_tokens(text) * 64, ids.size());  // not vacuous
  std::cout << "[ bpe ] " << GetParam() << ": " << text.size() << " bytes -> " << ids.size() << " tokens in " << s
            << " s\n";
}

INSTANTIATE_TEST_SUITE_P(Bpe, BpeFamilies, ::testing::Values("llama-bpe", "qwen2"),
                         [](const auto& p) { return p.param == "llama-bpe" ? "LlamaBpe" : "Qwen2"; });

// Qwen's user-defined tokens (<think>, <tool_call>) are matched in the text even without
// parse_special (llama.cpp's rule); its control tokens are not.
TEST(BpeQwen2, UserDefinedTokensAlwaysMatch) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const Tokenizer& tok = family_vocab("qwen2");
  const int32_t think = tok.token_id("<think>");
  ASSERT_EQ(tok.token_type(think), Tokenizer::kUserDefined);
  const auto ids = tok.encode("a<think>b", false);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], think);
  EXPECT_EQ(tok.token_to_piece(think), "<think>");
  EXPECT_EQ(tok.decode(ids), "a<think>b");
}

// The tiny models' vocabularies (the real ones cut to 2,048 tokens): llama.cpp's prompt ids for
// prompt.txt. Only the metadata is read (a tensor count of 0: the tokenizer needs no tensors).
TEST(BpeTinyModels, PromptIdsMatchLlamaCpp) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const std::vector<uint8_t> prompt = read_bytes(test::shared_path("models/families/prompt.txt"));
  const std::string text(prompt.begin(), prompt.end());
  for (const std::string name : {"tiny-llama3-Q4_K_M", "tiny-qwen2-Q5_K_M"}) {
    SCOPED_TRACE(name);
    std::vector<uint8_t> bytes = read_bytes(test::shared_path("models/families/" + name + ".gguf"));
    std::fill(bytes.begin() + 8, bytes.begin() + 16, uint8_t(0));  // the header's tensor count
    const GgufFile f = GgufFile::from_bytes(std::move(bytes), name);
    const Tokenizer tok = Tokenizer::from_gguf(f);
    std::ifstream in(test::shared_path("models/families/" + name + ".ref.json"));
    const auto ref = nlohmann::json::parse(in);
    const auto want = ref["prompt_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(text, tok.add_bos()), want);
    EXPECT_EQ(tok.n_vocab(), ref["n_vocab"].get<int32_t>());
  }
}

// ---- the pre-tokenizer against the regex, case by case (splits worked out from the pattern) ----

std::vector<std::string> words(std::string_view text, PreTokenizer kind) {
  std::vector<size_t> ends;
  pretokenize(text, kind, ends);
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t e : ends) {
    out.emplace_back(text.substr(at, e - at));
    at = e;
  }
  return out;
}

using W = std::vector<std::string>;

TEST(PreTokenize, RegexAlternatives) {
  const auto L = PreTokenizer::kLlama3, Q = PreTokenizer::kQwen2;
  EXPECT_EQ(words("Hello world", L), (W{"Hello", " world"}));
  EXPECT_EQ(words("", L), W{});
  // Contractions, ASCII case-insensitive, before letters.
  EXPECT_EQ(words("don't I'LL we'Re 'x", L), (W{"don", "'t", " I", "'LL", " we", "'Re", " '", "x"}));
  // \p{N}{1,3} against \p{N}.
  EXPECT_EQ(words("12345", L), (W{"123", "45"}));
  EXPECT_EQ(words("12345", Q), (W{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(words("a1", L), (W{"a", "1"}));
  // One non-letter, non-newline, non-digit character leads a letter run: a space, a tab, a '$'.
  EXPECT_EQ(words("\tb $x", L), (W{"\tb", " $", "x"}));
  EXPECT_EQ(words("$x", L), (W{"$x"}));
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*': punctuation takes one leading space and trailing newlines.
  EXPECT_EQ(words("a , b", L), (W{"a", " ,", " b"}));
  EXPECT_EQ(words("!!!\n\nx", L), (W{"!!!\n\n", "x"}));
  // \s*[\r\n]+ ends at the last newline of a white-space run.
  EXPECT_EQ(words("a\n\n b", L), (W{"a", "\n\n", " b"}));
  EXPECT_EQ(words("x  \n", L), (W{"x", "  \n"}));
  EXPECT_EQ(words(" \n \n  y", L), (W{" \n \n", " ", " y"}));
  // \s+(?!\S): a run before a word leaves its last space to the word; at the end it is whole.
  EXPECT_EQ(words("a   b", L), (W{"a", "  ", " b"}));
  EXPECT_EQ(words("a   ", L), (W{"a", "   "}));
  EXPECT_EQ(words("a \t!", L), (W{"a", " ", "\t", "!"}));
  // Unicode classes: letters with marks (é precomposed is a letter; a combining mark is not).
  EXPECT_EQ(words("caf\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD", L), (W{"caf\xC3\xA9", " \xE4\xBD\xA0\xE5\xA5\xBD"}));
  EXPECT_EQ(words("e\xCC\x81x", L), (W{"e", "\xCC\x81x"}));
  // U+00A0 and U+3000 are white space; U+0660 (Arabic-Indic zero) is a number.
  EXPECT_EQ(words("a\xC2\xA0\xC2\xA0"
                  "b",
                  L),
            (W{"a", "\xC2\xA0",
               "\xC2\xA0"
               "b"}));
  EXPECT_EQ(words("\xD9\xA0\xD9\xA0\xD9\xA0\xD9\xA0", L), (W{"\xD9\xA0\xD9\xA0\xD9\xA0", "\xD9\xA0"}));
}

// A stray byte splits as U+FFFD (a symbol) would, and stays one byte.
TEST(PreTokenize, InvalidUtf8SplitsAsReplacementCharacter) {
  const std::string fffd = "\xEF\xBF\xBD";
  for (const std::string& s : {std::string("ab\xFF"
                                           "cd"),
                               std::string(" \x80\x80 x"), std::string("1\xC3")}) {
    std::string replaced;
    for (unsigned char c : s) replaced += (c >= 0x80) ? fffd : std::string(1, static_cast<char>(c));
    const W a = words(s, PreTokenizer::kLlama3), b = words(replaced, PreTokenizer::kLlama3);
    ASSERT_EQ(a.size(), b.size()) << s;
    std::string joined;
    for (const auto& w : a) joined += w;
    EXPECT_EQ(joined, s);
  }
}

// ---- hostile or malformed byte-level vocabularies: one clear error each ----

struct BpeVocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
  std::string pre = "llama-bpe";
  bool with_pre = true, with_merges = true;
};

std::vector<uint8_t> write_bpe_vocab(const BpeVocab& v) {
  std::vector<uint8_t> b;
  auto u32 = [&](uint32_t x) {
    for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(x >> (8 * i)));
  };
  auto u64 = [&](uint64_t x) {
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(x >> (8 * i)));
  };
  auto str = [&](std::string_view s) {
    u64(s.size());
    for (char c : s) b.push_back(static_cast<uint8_t>(c));  // (insert: a GCC 12 -Wstringop-overflow false positive)
  };
  auto str_array = [&](const char* key, const std::vector<std::string>& a) {
    str(key);
    u32(9);
    u32(8);
    u64(a.size());
    for (const auto& s : a) str(s);
  };
  for (char c : std::string_view("GGUF")) b.push_back(static_cast<uint8_t>(c));
  u32(3);
  u64(0);
  u64(4 + v.with_pre + v.with_merges);
  str("tokenizer.ggml.model");
  u32(8);
  str("gpt2");
  if (v.with_pre) {
    str("tokenizer.ggml.pre");
    u32(8);
    str(v.pre);
  }
  str_array("tokenizer.ggml.tokens", v.tokens);
  str("tokenizer.ggml.token_type");
  u32(9);
  u32(5);
  u64(v.types.size());
  for (int32_t t : v.types) u32(static_cast<uint32_t>(t));
  if (v.with_merges) str_array("tokenizer.ggml.merges", v.merges);
  str("tokenizer.ggml.eos_token_id");
  u32(4);
  u32(static_cast<uint32_t>(v.tokens.size() - 1));
  return b;
}

// The 256 byte characters (GPT-2's byte-to-unicode order is irrelevant here: ids follow bytes),
// then `extra` normal tokens, then the control tokens <|begin_of_text|> and <|end_of_text|> (no keys
// for them but the eos id: BOS is found by its text).
BpeVocab bpe_mini(std::vector<std::string> extra, std::vector<std::string> merges) {
  BpeVocab v;
  // GPT-2's map written out: printable Latin-1 maps to itself, the rest to U+0100 + k in order.
  int k = 0;
  for (int b = 0; b < 256; ++b) {
    const bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const uint32_t c = self ? uint32_t(b) : 0x100u + uint32_t(k++);
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    v.tokens.push_back(s);
  }
  for (auto& e : extra) v.tokens.push_back(e);
  v.tokens.push_back("<|begin_of_text|>");
  v.tokens.push_back("<|end_of_text|>");
  v.types.assign(v.tokens.size(), 1);
  v.types.end()[-1] = v.types.end()[-2] = 3;
  v.merges = std::move(merges);
  return v;
}

std::string bpe_error(const BpeVocab& v) {
  try {
    const GgufFile f = GgufFile::from_bytes(write_bpe_vocab(v), "vocab");
    (void)Tokenizer::from_gguf(f);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "no exception";
}

Tokenizer bpe_make(const BpeVocab& v) {
  const GgufFile f = GgufFile::from_bytes(write_bpe_vocab(v), "vocab");
  return Tokenizer::from_gguf(f);
}

TEST(BpeMini, MergesByRankLeftmostFirst) {
  // "b c" has rank 0, "a b" rank 1: "abc" -> a + bc, whatever their order in the vocabulary.
  const Tokenizer t = bpe_make(bpe_mini({"ab", "bc"}, {"b c", "a b"}));
  EXPECT_EQ(t.encode("abc", false), (std::vector<int32_t>{'a', 257}));
  // Equal pairs: the leftmost merges first ("aaa" -> aa + a); then "aa aa" joins two of them.
  const Tokenizer u = bpe_make(bpe_mini({"aa", "aaaa"}, {"a a", "aa aa"}));
  EXPECT_EQ(u.encode("aaa", false), (std::vector<int32_t>{256, 'a'}));
  EXPECT_EQ(u.encode("aaaaa", false), (std::vector<int32_t>{257, 'a'}));
  EXPECT_EQ(u.decode(u.encode("aaaaa", false)), "aaaaa");
  // llama-bpe: a word that is a token is taken whole, without merges ("aaa" is no merge result).
  const Tokenizer w = bpe_make(bpe_mini({"aaa"}, {}));
  EXPECT_EQ(w.encode("aaa", false), (std::vector<int32_t>{256}));
  BpeVocab q = bpe_mini({"aaa"}, {});
  q.pre = "qwen2";
  EXPECT_EQ(bpe_make(q).encode("aaa", false), (std::vector<int32_t>{'a', 'a', 'a'}));
}

TEST(BpeMini, ValidationErrors) {
  BpeVocab v = bpe_mini({"ab"}, {"a b"});
  v.pre = "gpt-4o";
  EXPECT_THAT(bpe_error(v), HasSubstr("tokenizer.ggml.pre is 'gpt-4o', a pre-tokenizer this tokenizer does not have "
                                      "(supported: 'llama-bpe', 'qwen2')"));
  v = bpe_mini({"ab"}, {"a b"});
  v.with_pre = false;
  EXPECT_THAT(bpe_error(v), HasSubstr("tokenizer.ggml.pre is missing"));
  v = bpe_mini({"ab"}, {"a b"});
  v.with_merges = false;
  EXPECT_THAT(bpe_error(v), HasSubstr("tokenizer.ggml.merges is missing"));
  for (const std::string bad : {"ab", "a ", " ", ""}) {
    v = bpe_mini({"ab"}, {"a b", bad});
    EXPECT_THAT(bpe_error(v),
                HasSubstr("tokenizer.ggml.merges[1] = '" + bad + "': not two pieces separated by a space"));
  }
  v = bpe_mini({"ab"}, {"a xyz"});
  EXPECT_THAT(bpe_error(v), HasSubstr("tokenizer.ggml.merges[0] = 'a xyz': 'xyz' is not a token"));
  v = bpe_mini({"ab"}, {"b a"});
  EXPECT_THAT(bpe_error(v), HasSubstr("tokenizer.ggml.merges[0] = 'b a': the merged piece 'ba' is not a token"));
  v = bpe_mini({"ab"}, {"a b"});
  v.tokens[0x41] = "A?";  // the token of byte 'A' lost
  EXPECT_THAT(bpe_error(v), HasSubstr("has no token 'A' for the byte 0x41"));
  v = bpe_mini({"ab"}, {"a b"});
  v.types.pop_back();
  EXPECT_THAT(bpe_error(v), HasSubstr("tokenizer.ggml.token_type has 258 entries, tokens has 259"));
  v = bpe_mini({"ab"}, {"a b"});
  v.tokens.end()[-2] = "<|start|>";  // Llama-3 adds BOS by default: there must be one
  EXPECT_THAT(bpe_error(v),
              HasSubstr("tokenizer.ggml.add_bos_token is true but there is no tokenizer.ggml.bos_token_id"));
  v.pre = "qwen2";
  EXPECT_EQ(bpe_error(v), "no exception");
}

}  // namespace
}  // namespace locks
