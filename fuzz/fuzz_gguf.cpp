// libFuzzer target: GGUF parsing, dequantization of every tensor, and (when the input carries a
// vocabulary, SentencePiece or byte-level BPE) tokenizer construction plus encode/decode rounds on a
// fixed text and on the input's own last bytes, with and without special tokens. Format errors are expected and
// caught; anything else (crash, sanitizer report, other exception types escaping) is a bug.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "locks/gguf.h"
#include "locks/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const locks::GgufFile f = locks::GgufFile::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz");
    volatile float sink = 0;
    for (const auto& t : f.tensors()) {
      const std::vector<float> v = f.dequantize(t);
      if (!v.empty()) sink = sink + v.front() + v.back();
    }
    // Typed getters on every key: wrong types must throw, never misbehave.
    for (const auto& [key, value] : f.metadata()) {
      try {
        (void)f.get_u32(key);
      } catch (const std::exception&) {
      }
      try {
        (void)f.get_f32(key);
      } catch (const std::exception&) {
      }
      try {
        (void)f.get_bool_or(key, false);
      } catch (const std::exception&) {
      }
      try {
        (void)f.get_string(key);
      } catch (const std::exception&) {
      }
      try {
        (void)f.get_string_array(key);
      } catch (const std::exception&) {
      }
      try {
        (void)f.get_f32_array(key);
      } catch (const std::exception&) {
      }
      try {
        (void)f.get_i32_array(key);
      } catch (const std::exception&) {
      }
    }
    if (f.has_key("tokenizer.ggml.tokens")) {
      const locks::Tokenizer tok = locks::Tokenizer::from_gguf(f);
      const std::string_view fixed = " Hello  world\n\tcaf\xc3\xa9 \xf0\x9f\x99\x82 \xff<s> 123 <|im_start|>it's";
      const std::string_view tail(reinterpret_cast<const char*>(data) + size - std::min<size_t>(size, 96),
                                  std::min<size_t>(size, 96));
      for (const std::string_view text : {fixed, tail}) {
        for (const bool special : {false, true}) {
          try {
            const auto ids = tok.encode(text, tok.add_bos(), special);
            (void)tok.decode(ids);
            (void)tok.min_tokens(text);
          } catch (const std::runtime_error&) {  // (a vocabulary without BOS asked to add one)
          }
        }
      }
      (void)tok.token_id("<|im_start|>");
      (void)tok.is_end_of_generation(tok.eot());
    }
  } catch (const std::exception&) {
  }
  return 0;
}
