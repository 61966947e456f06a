// The tiny models of ../shared/models/families (real GGUF formats of the llama and qwen2 families)
// for tests that run them: loaded without a tokenizer, with llama.cpp's prompt token ids.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "locks/model.h"
#include "test_paths.h"

namespace locks::test {

/// The file stems of the tiny family models (ggml tensor types in the name).
inline const char* const kFamilyModels[] = {"tiny-llama3-Q4_K_M", "tiny-qwen2-Q5_K_M"};

inline LlamaModel load_family_model(const std::string& stem) {
  return LlamaModel::load(shared_path("models/families/" + stem + ".gguf"), ModelLoadOptions{.tokenizer = false});
}

/// llama.cpp's prompt token ids for the model (`prompt_ids` of its .ref.json: BOS + 1,500 bytes of text).
inline std::vector<int32_t> family_prompt_ids(const std::string& stem) {
  std::ifstream in(shared_path("models/families/" + stem + ".ref.json"));
  return nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
}

/// A gtest parameter name for a stem ("tiny_llama3_Q4_K_M").
inline std::string family_test_name(std::string stem) {
  for (char& c : stem)
    if (c == '-') c = '_';
  return stem;
}

}  // namespace locks::test
