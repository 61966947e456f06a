// Where tests find reference data. ../shared is read-only and present for CI.
#pragma once
#include <filesystem>
#include <string>

namespace locks::test {
inline std::string shared_path(const std::string& rel) { return std::string(LOCKS_SHARED_DIR) + "/" + rel; }
inline std::string source_path(const std::string& rel) { return std::string(LOCKS_SOURCE_DIR) + "/" + rel; }
inline bool shared_available() { return std::filesystem::exists(shared_path("models/tokenizer-vectors.json")); }
}  // namespace locks::test
