// Subcommands of the `locks` command line. Each registers its options on a CLI11 subcommand and
// returns the function that runs it (exit code).
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace locks::cli {

using Runner = std::function<int()>;

Runner add_run(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_eval(CLI::App& app);

/// Shared: the embedded default model path (models/locks-ref-a-q8_0.gguf, resolved).
std::string default_model_path();

}  // namespace locks::cli
