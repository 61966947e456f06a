// `locks eval`: needle-retrieval accuracy of selectors x budgets on real held-out text.
#include <fmt/format.h>
#include <omp.h>

#include <cstdio>
#include <filesystem>
#include <system_error>

#include "commands.h"
#include "locks/eval_runner.h"
#include "locks/selector.h"
#include "locks/session.h"
#include "paths.h"

namespace locks::cli {

Runner add_eval(CLI::App& app) {
  auto c = std::make_shared<EvalConfig>();
  auto threads = std::make_shared<int>(0);
  c->corpus_path = "../shared/data/heldout-text.txt.xz";
  app.add_option("-m,--model", c->model_path, "GGUF model (default: models/locks-ref-a-q8_0.gguf)")
      ->check(non_empty_path());
  app.add_option("--corpus", c->corpus_path, "held-out documents (.txt or .txt.xz, 0x1E-separated)")
      ->check(non_empty_path())
      ->capture_default_str();
  app.add_option("--tasks", c->families, "task families: single, multikey, multiquery, continuation")
      ->delimiter(',')
      ->transform(trimmed())
      ->capture_default_str();
  app.add_option("--lengths", c->lengths, "task lengths in tokens")
      ->delimiter(',')
      ->transform(decimal_integer())
      ->transform(trimmed())  // (CLI11 runs the transform added last first)
      ->capture_default_str();
  app.add_option("--budgets", c->budgets, "budgets in tokens (multiples of 16, >= 32)")
      ->delimiter(',')
      ->transform(decimal_integer())
      ->transform(trimmed())  // (CLI11 runs the transform added last first)
      ->capture_default_str();
  app.add_option(
         "--selectors", c->selectors,
         "selectors, each NAME or NAME/key=value/... (keys: r, basis, coef, centroid, rule, rho; for locks's "
         "adaptive budget p or cert, min, max, and per-page ranks bytes), e.g. locks/r=4, locks/basis=2, "
         "locks/rule=max, "
         "sequence-basis/rho=8 (rho=0: the rank whose bytes match LOCKS's), locks/p=0.5/max=1024 (the fewest "
         "top pages whose estimated group share reaches 0.5, at most 1024 tokens); names: " +
             [] {
               std::string n;
               for (const auto& x : selector_names()) n += (n.empty() ? "" : ", ") + x;
               return n;
             }())
      ->delimiter(',')
      ->transform(trimmed())
      ->capture_default_str();
  auto device = std::make_shared<std::string>("cpu");
  app.add_option("--device", *device,
                 "cpu, or cuda: the model on the GPU (selectors full, locks, oracle in the shipped format with a fixed "
                 "budget; no fidelity chain, locality or tail finding)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_flag("!--no-fidelity", c->fidelity, "skip the per-step fidelity chain (faster)");
  app.add_flag("!--separate-contexts", c->share_contexts,
               "give multikey its own contexts (default: it asks the first question of each multiquery context)");
  app.add_option("--locality-contexts", c->locality_contexts, "contexts per length measured for the locality finding")
      ->transform(decimal_integer())
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--tail-contexts", c->tail_contexts,
                 "contexts per length whose full-attention fork measures the tail finding (needs selector full): "
                 "the summary's per-page error at every decode step against page properties, tails.csv")
      ->transform(decimal_integer())
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--continuation-tokens", c->continuation_tokens, "teacher-forced tokens of the continuation task")
      ->transform(decimal_integer())
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--contexts", c->contexts, "contexts per (task, length)")
      ->transform(decimal_integer())
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--seed", c->seed, "task seed")->transform(decimal_integer(true))->capture_default_str();
  app.add_option("-r,--rank", c->summary.rank, "LOCKS summary rank r")
      ->transform(decimal_integer())
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  app.add_option("--out", c->out_dir,
                 "output directory: results.csv, summary.md, locality.csv and SVG plots (a reused directory first "
                 "loses the previous run's summary.md, locality.csv, tails.csv and plots: accuracy_vs_budget_*, "
                 "accuracy_vs_bytes_*, carrier_retention_vs_budget_*, error_ladder_*, locality_*, tail_*.svg)")
      ->check(non_empty_path())
      ->capture_default_str();
  app.add_option("--from-csv", c->from_csv,
                 "report rows of earlier runs of one model instead of running: results.csv files (comma-separated; "
                 "their rows concatenated, a row twice refused) into --out's summary.md, results.csv and plots "
                 "(no locality or tail finding; the options of a run are not read)")
      ->delimiter(',')
      ->check(CLI::ExistingFile);
  app.add_option("--threads", *threads, "CPU threads (default: all cores)")
      ->transform(decimal_integer())
      ->check(CLI::Range(1, 1024));
  return [c, threads, device] {
    if (*threads > 0) omp_set_num_threads(*threads);
    EvalConfig cfg = *c;
    if (!cfg.from_csv.empty()) {
      if (cfg.out_dir.empty()) throw CLI::ValidationError("--out", "empty output directory");
      for (const auto& f : cfg.from_csv)
        if (std::filesystem::weakly_canonical(f) ==
            std::filesystem::weakly_canonical(std::filesystem::path(cfg.out_dir) / "results.csv"))
          throw CLI::ValidationError("--from-csv", fmt::format("'{}' is the results.csv --out would write", f));
      const std::vector<EvalRow> rows = read_eval_rows(cfg.from_csv);
      cfg = report_eval_rows(cfg, rows);
      fmt::print("{}", eval_summary_markdown(cfg, rows));
      diag("[eval] wrote {} rows' results.csv, summary.md and the plots to {}\n", rows.size(), cfg.out_dir);
      return 0;
    }
    cfg.device = parse_device(*device);
    if (cfg.device == Device::kCuda) {  // both read the CPU's KV cache (--device's help says so)
      cfg.fidelity = false;
      cfg.locality_contexts = 0;
    }
    if (cfg.model_path.empty()) cfg.model_path = default_model_path();
    cfg.corpus_path = resolve_default_path(cfg.corpus_path);
    // Usage errors (bad selector specs, families, budgets) exit 2 like other bad options.
    try {
      auto no_repeats = [](const auto& v, const char* what) {
        if (const std::string r = first_repeat(v); !r.empty())
          throw std::invalid_argument(fmt::format("{} '{}' given twice", what, r));
      };
      no_repeats(cfg.selectors, "selector");
      no_repeats(cfg.budgets, "budget");
      no_repeats(cfg.lengths, "length");
      no_repeats(cfg.families, "task");
      if (cfg.out_dir.empty()) throw std::invalid_argument("--out: empty output directory");
      // Before the model and corpus load (run_eval checks again as it creates the directory).
      if (std::error_code ec;
          std::filesystem::exists(cfg.out_dir, ec) && !std::filesystem::is_directory(cfg.out_dir, ec))
        throw std::invalid_argument(fmt::format("output directory '{}': not a directory", cfg.out_dir));
      std::vector<SelectorSpec> specs;
      for (const auto& s : cfg.selectors) {
        // Variant values checked now (page size 16, head_dim 64 of the reference format), not after
        // the model and corpus load.
        const SelectorSpec spec = parse_selector_spec(s, cfg.summary);
        // Two spellings of one configuration ("locks" and "locks/r=8") would run it twice.
        for (const SelectorSpec& other : specs)
          if (same_selector(other.name, other.opts, spec.name, spec.opts) && other.max_tokens == spec.max_tokens)
            throw std::invalid_argument(
                fmt::format("selectors '{}' and '{}' are the same configuration", other.label, s));
        specs.push_back(spec);
        if (const std::string why = device_refusal(cfg.device, spec.name, spec.opts); !why.empty())
          throw std::invalid_argument(why);
        try {
          spec.opts.summary.validate(16, 64);
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument(fmt::format("selector '{}': {}", s, e.what()));
        }
        if (spec.opts.shared_rank < 0 || spec.opts.shared_rank > 64)
          throw std::invalid_argument(fmt::format("selector '{}': rho {} outside [0, 64]", s, spec.opts.shared_rank));
      }
      check_eval_config(cfg);  // families, selector specs, budgets, lengths, continuation tokens
      cfg.summary.validate(16, 64);
    } catch (const std::invalid_argument& e) {
      throw CLI::ValidationError("eval", e.what());
    }
    bool progress_shown = false;
    auto progress = [&progress_shown](int done, int total, const std::string& what) {
      diag("\r[eval] {:>4}/{} contexts | {:<60}", done, total, what);
      progress_shown = true;
    };
    std::vector<EvalRow> rows;
    try {
      rows = run_eval(cfg, progress, [&progress_shown](const std::string& note) {
        if (progress_shown) diag("\n");  // not on the progress line
        progress_shown = false;
        warn_model_defaults({note});
      });
    } catch (...) {
      if (progress_shown) diag("\n");  // end the progress line before the error
      throw;
    }
    diag("\n");
    fmt::print("{}", eval_summary_markdown(cfg, rows));
    diag("[eval] wrote results.csv, summary.md, locality.csv{} and the plots to {}\n",
         cfg.tail_contexts > 0 ? ", tails.csv" : "", cfg.out_dir);
    return 0;
  };
}

}  // namespace locks::cli
