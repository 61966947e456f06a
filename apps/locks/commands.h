// Subcommands of the `locks` command line. Each registers its options on a CLI11 subcommand and
// returns the function that runs it (exit code).
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace locks::cli {

/// Diagnostics (warnings, progress, the stats line, errors) on stderr. A stderr that cannot be
/// written (closed, a full disk) loses them but fails nothing: fmt::print would throw there, and its
/// exception, printed by the error handler to the same stderr, would end in std::terminate.
template <typename... Args>
void diag(fmt::format_string<Args...> format, Args&&... args) {
  const std::string text = fmt::format(format, std::forward<Args>(args)...);
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

using Runner = std::function<int()>;

Runner add_run(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_eval(CLI::App& app);
Runner add_tokenize(CLI::App& app);

/// Shared: the embedded default model path (models/locks-ref-a-q8_0.gguf, resolved).
std::string default_model_path();

/// Shared: a loaded model's notes (LlamaModel::defaults_used) as "[locks] warning: ..." lines on stderr.
void warn_model_defaults(const std::vector<std::string>& notes);

/// Shared, for list options: the first item of `v` given twice, as text ("" when none repeats), since
/// a repeated context, budget or length would only measure the same thing again.
template <typename T>
std::string first_repeat(const std::vector<T>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (std::find(v.begin(), v.begin() + std::ptrdiff_t(i), v[i]) != v.begin() + std::ptrdiff_t(i))
      return fmt::format("{}", v[i]);
  return std::string();
}

/// Shared, for path options: an empty path is an error (not "use the default").
inline CLI::Validator non_empty_path() {
  return CLI::Validator([](std::string& s) { return s.empty() ? std::string("empty path") : std::string(); }, "PATH");
}

/// Shared, for float options: the whole text is a decimal number (before a range check, which would call
/// "12abc" out of range).
inline CLI::Validator number_text() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        // Decimal text only (strtod alone would also take hex floats, "inf" and "nan").
        const bool decimal = !s.empty() && s.find_first_not_of("0123456789+-.eE") == std::string::npos;
        char* end = nullptr;
        if (decimal) std::strtod(s.c_str(), &end);
        return end == nullptr || end != s.c_str() + s.size() ? "'" + s + "' is not a number" : std::string();
      },
      "");  // (no type name of its own: --help shows the option's FLOAT and its range)
}

/// Shared, for string list items (use with ->transform): surrounding blanks dropped, so that
/// "full, locks" names the selectors full and locks.
inline CLI::Validator trimmed() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
        s = b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
        return std::string();
      },
      "");
}

/// CLI11 drops the empty items of a comma list ("128,,256" would run 128 and 256): the first
/// comma-list option of `sub` in `args` with an empty item, as "--budgets: empty item in '128,,256'"
/// (empty when there is none).
inline std::string empty_list_item(const CLI::App& sub, const std::vector<std::string>& args) {
  for (const CLI::Option* opt : sub.get_options()) {
    if (opt->get_delimiter() != ',') continue;
    for (const std::string& name : opt->get_lnames()) {
      const std::string flag = "--" + name;
      for (size_t i = 0; i < args.size(); ++i) {
        std::string value;
        if (args[i] == flag && i + 1 < args.size())
          value = args[i + 1];
        else if (args[i].rfind(flag + "=", 0) == 0)
          value = args[i].substr(flag.size() + 1);
        else
          continue;
        // (an item of blanks is empty too: "128, ,256")
        for (size_t b = 0, e; b <= value.size(); b = e + 1) {
          e = std::min(value.find(',', b), value.size());
          if (value.find_first_not_of(" \t", b) >= e) return flag + ": empty item in '" + value + "'";
        }
      }
    }
  }
  return std::string();
}

/// Shared, for integer options (use with ->transform): decimal digits only, leading zeros dropped,
/// because CLI11's own conversion detects the base ("010" would be octal, "0x10" hex) and calls
/// "1e3" or "1.5" out of range. Values above INT32_MAX are refused here (the option's range check
/// follows); with `uint64`, values up to UINT64_MAX pass (CLI11 wraps "-1" and saturates overflow).
inline CLI::Validator decimal_integer(bool uint64 = false) {
  return CLI::Validator(
      [uint64](std::string& s) -> std::string {
        const uint64_t max = uint64 ? UINT64_MAX : uint64_t(INT32_MAX);
        uint64_t v = 0;
        bool digits = !s.empty(), fits = true;
        for (char ch : s) {
          if (ch < '0' || ch > '9') {
            digits = false;
            break;
          }
          if (v > (max - uint64_t(ch - '0')) / 10) fits = false;
          if (fits) v = v * 10 + uint64_t(ch - '0');
        }
        const bool negative = s.size() > 1 && s[0] == '-' && s.find_first_not_of("0123456789", 1) == std::string::npos;
        if (negative) return "'" + s + "' is negative";
        if (!digits || (uint64 && !fits))
          return "'" + s + "' is not a decimal integer" + (uint64 ? " in [0, " + std::to_string(max) + "]" : "");
        if (!fits) return "'" + s + "' is too large";
        s = std::to_string(v);
        return std::string();
      },
      "");  // (no type name of its own: --help shows the option's INT and its range)
}

}  // namespace locks::cli
