// Chat prompts of the model families: one user turn (after an optional system message) and the
// assistant's header, as the families' chat templates write them (Meta's Llama-3 template; ChatML,
// which Qwen2.5 and Qwen3 use). What `locks run --chat` sends; generation then stops at the model's
// end-of-turn token (Tokenizer::is_end_of_generation).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "locks/tokenizer.h"

namespace locks {

enum class ChatFormat { kLlama3, kChatML };
std::string chat_format_name(ChatFormat f);  // "llama3" / "chatml"

/// The vocabulary's chat format, from its special tokens: Llama-3 (<|begin_of_text|>,
/// <|start_header_id|>, <|end_header_id|>, <|eot_id|>) or ChatML (<|im_start|>, <|im_end|>). Throws
/// std::invalid_argument naming the tokens it looked for when the vocabulary has neither set (the
/// SentencePiece models here have no chat tokens).
ChatFormat chat_format(const Tokenizer& tok);

/// Token ids of the prompt:
///   llama3: <|begin_of_text|> [<|start_header_id|>system<|end_header_id|>\n\n SYSTEM <|eot_id|>]
///           <|start_header_id|>user<|end_header_id|>\n\n USER <|eot_id|>
///           <|start_header_id|>assistant<|end_header_id|>\n\n
///   chatml: [<|im_start|>system\n SYSTEM <|im_end|>\n] <|im_start|>user\n USER <|im_end|>\n <|im_start|>assistant\n
/// (Llama-3 trims the texts, as its template does). The texts are encoded as plain text: control-token
/// text inside them stays text. An empty system text leaves the system turn out. Throws what
/// chat_format throws.
std::vector<int32_t> chat_prompt(const Tokenizer& tok, std::string_view user, std::string_view system = {});

}  // namespace locks
