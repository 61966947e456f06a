// Subcommands of the `locks` command line. Each registers its options on a CLI11 subcommand and
// returns the function that runs it (exit code).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>

namespace locks::cli {

using Runner = std::function<int()>;

Runner add_run(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_eval(CLI::App& app);

/// Shared: the embedded default model path (models/locks-ref-a-q8_0.gguf, resolved).
std::string default_model_path();

/// Shared: the whole text is a number (before a range check, which would call "12abc" out of range).
inline CLI::Validator number_text() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        std::strtod(s.c_str(), &end);
        return s.empty() || end != s.c_str() + s.size() ? "'" + s + "' is not a number" : std::string();
      },
      "NUMBER");
}

/// Shared: a decimal integer in [0, 2^64) (CLI11's own conversion wraps "-1" and saturates overflow).
inline CLI::Validator uint64_text() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        for (char ch : s) {
          if (ch < '0' || ch > '9' || v > (UINT64_MAX - uint64_t(ch - '0')) / 10)
            return "'" + s + "' is not an integer in [0, 18446744073709551615]";
          v = v * 10 + uint64_t(ch - '0');
        }
        return s.empty() ? std::string("empty value") : std::string();
      },
      "UINT64");
}

}  // namespace locks::cli
