// `locks`: run | eval | bench | tokenize. Errors become one line on stderr and a non-zero exit code
// (2 for bad command-line usage, 1 for failures while running).
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <iostream>
#include <map>
#include <memory>
#include <new>
#include <regex>
#include <string>
#include <vector>

#include "commands.h"

namespace {

using locks::cli::diag;

// Every error ends as this one line on stderr.
void print_error(const std::string& what) { diag("locks: error: {}\n", what); }

// CLI11 shows an option's type and then each check's own description: "INT:INT in [32 - 67108864]",
// "TEXT:PATH", "TEXT:{f16,f32}". The check says more than the type, so --help shows it alone; and a
// flag that sets false ("--no-fidelity{false}") without the value it stores.
class Formatter : public CLI::Formatter {
 public:
  std::string make_option_opts(const CLI::Option* opt) const override {
    static const std::regex base_type("^ [A-Z]+:");
    return std::regex_replace(CLI::Formatter::make_option_opts(opt), base_type, " ");
  }
  std::string make_option_name(const CLI::Option* opt, bool is_positional) const override {
    static const std::regex flag_value("\\{(true|false)\\}");
    return std::regex_replace(CLI::Formatter::make_option_name(opt, is_positional), flag_value, "");
  }
};

// CLI11's "--max-tokens: 1 required INT:INT in [0 - 16777216] missing" (an option given without its
// value) as "--max-tokens: needs a value (INT in [0 - 16777216])", the type shown once as in --help.
std::string usage_message(const CLI::ParseError& e) {
  static const std::regex missing(": 1 required (?:[A-Z]+:)?(.*) missing$");
  return std::regex_replace(e.what(), missing, ": needs a value ($1)");
}

int locks_main(int argc, char** argv) {
  CLI::App app{
      "locks: LOCKS sparse decode attention (page-local compact key summaries) in a Llama engine on the CPU "
      "or a CUDA GPU",
      "locks"};
  app.formatter(std::make_shared<Formatter>());  // (subcommands inherit it)
  app.require_subcommand(0, 1);
  app.set_version_flag("--version", std::string("locks ") + LOCKS_VERSION);
  std::map<CLI::App*, locks::cli::Runner> runners;
  auto add = [&](const char* name, const char* desc, locks::cli::Runner (*fn)(CLI::App&)) {
    CLI::App* sub = app.add_subcommand(name, desc);
    runners[sub] = fn(*sub);
  };
  add("run", "generate text with a selector (default when no subcommand is given)", locks::cli::add_run);
  add("bench", "decode-attention and engine speed benchmarks", locks::cli::add_bench);
  add("eval", "needle-retrieval accuracy of selectors on real held-out text", locks::cli::add_eval);
  add("tokenize", "a text's token ids under a model's vocabulary (as llama.cpp's llama-tokenize)",
      locks::cli::add_tokenize);
  // `run` is the default subcommand: `locks -p TEXT ...` means `locks run -p TEXT ...`.
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args[0].size() > 1 && args[0][0] == '-' && args[0] != "-h" && args[0] != "--help" &&
      args[0] != "--version")
    args.insert(args.begin(), "run");
  // "--name=" with nothing after '=' is an empty value, as `--name ""` is: CLI11 would take the next
  // argument instead ("--prompt= --json" prompting with the text "--json", "--out= --no-fidelity"
  // writing to a directory named "--no-fidelity").
  // (Not where the argument is itself an option's value: `-p "--x="` prompts with "--x=".)
  const CLI::App* named = nullptr;
  for (const auto& entry : runners)
    if (!args.empty() && entry.first->get_name() == args[0]) named = entry.first;
  auto takes_value = [&](const std::string& arg) {
    const CLI::Option* opt = named && arg.find('=') == std::string::npos ? named->get_option_no_throw(arg) : nullptr;
    return opt != nullptr && opt->get_items_expected_min() > 0;
  };
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--") break;
    if (args[i].size() > 3 && args[i].rfind("--", 0) == 0 && args[i].find('=') == args[i].size() - 1 &&
        !takes_value(args[i - 1])) {
      args[i].pop_back();
      args.insert(args.begin() + std::ptrdiff_t(++i), std::string());
    }
  }
  if (named)
    if (const std::string why = locks::cli::empty_list_item(*named, args); !why.empty()) {
      print_error(why);
      return 2;
    }
  // An unknown subcommand is an error even with --help (which CLI11 would answer with the main help).
  if (!named && !args.empty() && !args[0].empty() && args[0][0] != '-') {
    print_error("unknown subcommand '" + args[0] + "' (run, bench, eval, tokenize)");
    return 2;
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector form in reverse order
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);  // prints the help of the (sub)command asked about
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);  // prints "locks X.Y.Z"
  } catch (const CLI::ParseError& e) {
    print_error(usage_message(e));
    return 2;
  }
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
    // No subcommand: the main job, `locks run` on its embedded defaults.
    CLI::App* run_app = app.get_subcommand("run");
    run_app->parse(std::vector<std::string>{});
    return runners[run_app]();
  } catch (const CLI::ParseError& e) {
    print_error(usage_message(e));
    return 2;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);  // what the command printed so far comes before the error
    print_error(
        "out of memory: use less context (run: -c/--ctx; eval: --lengths; bench: --contexts, --kv-heads, "
        "--batches)");
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    print_error(e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int rc = locks_main(argc, argv);
  // Output that could not be written (a full disk, a closed pipe) is a failure, not a success.
  std::cout.flush();
  if (!std::cout || std::fflush(stdout) != 0 || std::ferror(stdout)) {
    print_error("could not write to standard output");
    return rc != 0 ? rc : 1;
  }
  return rc;
}
