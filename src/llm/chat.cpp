// Chat prompts (locks/chat.h).
#include "locks/chat.h"

#include <stdexcept>

namespace locks {

namespace {

std::string_view trim(std::string_view s) {
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

bool has_all(const Tokenizer& tok, std::initializer_list<std::string_view> texts) {
  for (std::string_view t : texts)
    if (tok.token_id(t) < 0) return false;
  return true;
}

}  // namespace

std::string chat_format_name(ChatFormat f) { return f == ChatFormat::kLlama3 ? "llama3" : "chatml"; }

ChatFormat chat_format(const Tokenizer& tok) {
  if (has_all(tok, {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}))
    return ChatFormat::kLlama3;
  if (has_all(tok, {"<|im_start|>", "<|im_end|>"})) return ChatFormat::kChatML;
  throw std::invalid_argument(
      "--chat: the vocabulary has no chat tokens (Llama-3's <|start_header_id|>, <|end_header_id|>, <|eot_id|>, or "
      "ChatML's <|im_start|>, <|im_end|>)");
}

std::vector<int32_t> chat_prompt(const Tokenizer& tok, std::string_view user, std::string_view system) {
  const ChatFormat f = chat_format(tok);
  std::vector<int32_t> ids;
  const auto token = [&](std::string_view t) { ids.push_back(tok.token_id(t)); };
  const auto text = [&](std::string_view t) {
    const std::vector<int32_t> e = tok.encode(t, /*add_bos=*/false);
    ids.insert(ids.end(), e.begin(), e.end());
  };
  if (f == ChatFormat::kLlama3) {
    const auto header = [&](std::string_view role) {
      token("<|start_header_id|>");
      text(role);
      token("<|end_header_id|>");
      text("\n\n");
    };
    const auto turn = [&](std::string_view role, std::string_view content) {
      header(role);
      text(trim(content));
      token("<|eot_id|>");
    };
    token("<|begin_of_text|>");
    if (!system.empty()) turn("system", system);
    turn("user", user);
    header("assistant");
  } else {
    const auto header = [&](std::string_view role) {
      token("<|im_start|>");
      text(std::string(role) + "\n");
    };
    const auto turn = [&](std::string_view role, std::string_view content) {
      header(role);
      text(content);
      token("<|im_end|>");
      text("\n");
    };
    if (!system.empty()) turn("system", system);
    turn("user", user);
    header("assistant");
  }
  return ids;
}

}  // namespace locks
