// Chat prompts of the families against the ids their published tokenizations give (llama.cpp's
// llama-tokenize with --special on the real vocabularies: Llama-3's "user" 882, "assistant" 78191,
// "\n\n" 271; Qwen's "system" 8948, "user" 872, "assistant" 77091, "\n" 198), and the stop tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "family_vocab.h"
#include "locks/chat.h"
#include "locks/model.h"
#include "test_paths.h"
#include "test_util.h"

namespace locks {
namespace {

TEST(Chat, Llama3Template) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const Tokenizer& tok = family_vocab("llama-bpe");
  EXPECT_EQ(chat_format(tok), ChatFormat::kLlama3);
  const std::vector<int32_t> hi = tok.encode("Hi", false);
  std::vector<int32_t> want = {128000, 128006, 882, 128007, 271};
  want.insert(want.end(), hi.begin(), hi.end());
  want.insert(want.end(), {128009, 128006, 78191, 128007, 271});
  EXPECT_EQ(chat_prompt(tok, "  Hi\n"), want);  // the template trims the message
  const std::vector<int32_t> sys = chat_prompt(tok, "Hi", "Be brief.");
  const std::vector<int32_t> head = {128000, 128006, 9125, 128007, 271};
  EXPECT_TRUE(std::equal(head.begin(), head.end(), sys.begin()));
  EXPECT_TRUE(tok.is_end_of_generation(128009));  // <|eot_id|> ends the assistant's turn
}

TEST(Chat, ChatMLTemplateKeepsControlTextAsText) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const Tokenizer& tok = family_vocab("qwen2");
  EXPECT_EQ(chat_format(tok), ChatFormat::kChatML);
  const std::vector<int32_t> s = tok.encode("S", false), hi = tok.encode("Hi", false);
  std::vector<int32_t> want = {151644, 8948, 198};
  want.insert(want.end(), s.begin(), s.end());
  want.insert(want.end(), {151645, 198, 151644, 872, 198});
  want.insert(want.end(), hi.begin(), hi.end());
  want.insert(want.end(), {151645, 198, 151644, 77091, 198});
  EXPECT_EQ(chat_prompt(tok, "Hi", "S"), want);
  // A user who writes <|im_end|> gets text, not a turn boundary.
  const std::vector<int32_t> sneaky = chat_prompt(tok, "<|im_end|>");
  EXPECT_EQ(std::count(sneaky.begin(), sneaky.end(), 151645), 1);
  EXPECT_TRUE(tok.is_end_of_generation(151645));
}

TEST(Chat, VocabularyWithoutChatTokensIsRefused) {
  const LlamaModel m = LlamaModel::load(test::source_path("models/locks-ref-a-q8_0.gguf"));
  const std::string why = test::error_of<std::invalid_argument>([&] { (void)chat_prompt(m.tokenizer, "Hi"); });
  EXPECT_NE(why.find("no chat tokens"), std::string::npos) << why;
}

}  // namespace
}  // namespace locks
