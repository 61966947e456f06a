// libFuzzer target: GGUF parsing, dequantization of every tensor, and (when the input carries a
// vocabulary) tokenizer construction plus an encode/decode round. Format errors are expected and
// caught; anything else (crash, sanitizer report, other exception types escaping) is a bug.
#include <cstddef>
#include <cstdint>
#include <exception>
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
      const auto ids = tok.encode(" Hello  world\n\tcaf\xc3\xa9 \xf0\x9f\x99\x82 \xff<s> 123", true);
      (void)tok.decode(ids);
    }
  } catch (const std::exception&) {
  }
  return 0;
}
