// `locks eval`: one harness for every selector on real held-out text (the paper's Sec. 5).
// Each context is prefilled once (dense, as in the paper); every selector x budget forks that
// prefilled sequence and pushes the questions and answers through decode, teacher-forced, scoring
// exact match, while a FidelityProbe measures the per-step chain at the answer steps. With both
// multikey and multiquery, one four-needle context serves both (multikey asks its first question).
// The forks of a context run in parallel, one per thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "locks/needle_task.h"
#include "locks/page_summary.h"
#include "locks/selector.h"
#include "locks/session.h"

namespace locks {

/// A selector as the evaluation names it: a registry name plus optional variant settings,
/// written "name/key=value/...", e.g. "locks/r=4", "locks/basis=2", "locks/rule=max",
/// "sequence-basis/rho=8", "locks/cert=0.9/min=64/max=1024". Keys: r (rank), basis (32|16|8|4|2),
/// coef (32|8), centroid (32|8), rule (share-average|max|mass-sum), rho (shared-basis rank; 0 =
/// matched bytes); for locks's adaptive budget (BudgetRule) p or cert (the target share, in (0, 1)),
/// min (tokens kept at least) and max (tokens kept at most: the spec then runs once, at that budget,
/// instead of at every --budgets value, which otherwise serve as its maximum).
struct SelectorSpec {
  std::string label;  // the string as given
  std::string name;   // registry name
  SelectorOptions opts;
  int max_tokens = 0;  // max=: the one budget an adaptive spec runs at (0: the --budgets grid)
};
/// Throws std::invalid_argument naming the bad key or value, or a key given twice.
SelectorSpec parse_selector_spec(const std::string& spec, const SummaryFormat& base);

struct EvalConfig {
  std::string model_path;
  std::string corpus_path;                           // .txt or .txt.xz, documents separated by 0x1E
  std::vector<std::string> families = {"multikey"};  // single, multikey, multiquery, continuation
  std::vector<int> lengths = {16384};                // tokens per task (context + questions + answers)
  std::vector<int> budgets = {256, 512, 1024};
  std::vector<std::string> selectors = {"full", "oracle", "locks"};  // SelectorSpec strings
  int contexts = 20;                                                 // per (family, length)
  uint64_t seed = 1;
  SummaryFormat summary;      // base LOCKS summary format
  bool fidelity = true;       // FidelityProbe at answer steps
  int locality_contexts = 3;  // contexts per length measured for the locality finding
  /// Contexts per length whose full-attention fork (selector `full` must be in the list) measures
  /// the tail finding (locks/tail_finding.h) with the base summary format, at every decode step of
  /// the questions and answers.
  int tail_contexts = 0;
  int continuation_tokens = 64;  // teacher-forced tokens of the continuation task
  bool share_contexts = true;    // multikey = the first question of each multiquery context
  int fork_threads = 0;          // forks of a context run at once (0: one per OpenMP thread)
  /// Where the model runs. CUDA: selectors full, locks and oracle (device_refusal); no fidelity chain
  /// and no locality finding (they read the CPU's cache); forks one at a time.
  Device device = Device::kCpu;
  std::string out_dir = "eval-out";
  /// Report rows read back from these results.csv files instead of running (report_eval_rows).
  std::vector<std::string> from_csv;
};

/// One (context, selector, budget) outcome; budget-free selectors (full) run once with budget 0.
struct EvalRow {
  std::string family;
  int length = 0;
  int context = 0;
  uint64_t task_seed = 0;
  std::string selector;
  int budget = 0;
  bool correct = false;           // retrieval: every answer token of every question right
  int answer_tokens = 0;          // continuation: teacher-forced tokens
  int answer_tokens_correct = 0;  // continuation: top-1 agreements with full attention
  double kl_vs_full = 0;          // continuation: mean KL(full || selector) per token (nats)
  int64_t decode_steps = 0;
  double bytes_read_per_step = 0;
  double dense_bytes_per_step = 0;
  double read_ratio = 0;  // bytes_read / dense
  int prompt_tokens = 0;
  double decode_seconds = 0;
  // Tokens each (layer, KV head) selection of a decode step kept (pages x page size): mean, median and
  // 95th percentile over the fork's steps (NaN on the GPU, which does not report them); and the
  // fraction of adaptive selections that reached their target share within the budget (NaN for a
  // fixed budget).
  double budget_mean = 0, budget_p50 = 0, budget_p95 = 0, mass_target_met = 0;
  // Fidelity chain at the answer steps (NaN where not applicable).
  double lse_mae = 0, logit_mae = 0, spearman = 0, coverage = 0, worst_head_coverage = 0, oracle_coverage = 0,
         output_rel_err = 0, carrier_retention = 0, carrier_retention_any = 0, carrier_obs = 0;
};

/// The checks of `cfg` that need neither the model nor the corpus: task families, selector specs,
/// budgets (multiples of 16, >= 32), lengths (>= 256), contexts and continuation tokens (>= 1, at
/// most half of each length when the continuation task runs). Throws std::invalid_argument naming
/// the value. run_eval calls it first; a front end can call it to fail before loading anything.
void check_eval_config(const EvalConfig& cfg);

/// Run the grid. Rows are appended to out_dir/results.csv as they finish (an interrupted run keeps
/// them); summary.md, locality.csv and the SVG plots are written at the end; a reused out_dir first
/// loses the previous run's report (remove_eval_report). `progress` (optional) is called as contexts
/// start and finish; `warn` (optional) with each of the model's notes (LlamaModel::defaults_used).
/// Throws std::invalid_argument for unknown families, selectors or bad budgets, std::runtime_error
/// for an unreadable model/corpus or unwritable out_dir.
std::vector<EvalRow> run_eval(const EvalConfig& cfg,
                              const std::function<void(int done, int total, const std::string& what)>& progress = {},
                              const std::function<void(const std::string& note)>& warn = {});

/// The rows of results.csv files that run_eval wrote (concatenated in order; files of earlier
/// versions without the budget columns read those as NaN). Throws std::runtime_error naming the file
/// and line for a file that cannot be read, a header that is not results.csv's or a bad row.
std::vector<EvalRow> read_eval_rows(const std::vector<std::string>& paths);
/// The report of rows read back (read_eval_rows) into cfg.out_dir: results.csv (the rows), summary.md
/// and the plots, as run_eval would have written them for these rows (no locality or tail finding).
/// Families, lengths, selectors and budgets come from the rows, in order of first appearance; the
/// contexts per (task, length) from their count; the fidelity tables where a row has fidelity values.
/// Returns the configuration it reported under. Throws as ResultsCsv / the writers for an unwritable
/// cfg.out_dir, std::invalid_argument for no rows.
EvalConfig report_eval_rows(EvalConfig cfg, const std::vector<EvalRow>& rows);

/// Markdown report from finished rows: accuracy per (family, length) as selector x budget, the
/// continuation agreement, and the fidelity chain per selector x budget.
std::string eval_summary_markdown(const EvalConfig& cfg, const std::vector<EvalRow>& rows);

}  // namespace locks
