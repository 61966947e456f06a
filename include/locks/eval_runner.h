// `locks eval`: needle-retrieval accuracy of selectors on real held-out text. Each context is
// prefilled once (dense, as in the paper); every selector x budget forks that prefilled sequence and
// pushes the questions and answers through decode, teacher-forced, scoring exact match.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "locks/needle_task.h"
#include "locks/page_summary.h"

namespace locks {

struct EvalConfig {
  std::string model_path;
  std::string corpus_path;                 // .txt or .txt.xz, documents separated by 0x1E
  std::vector<std::string> families = {"multikey"};
  std::vector<int> lengths = {16384};      // tokens per task (context + questions + answers)
  std::vector<int> budgets = {256, 512, 1024};
  std::vector<std::string> selectors = {"full", "oracle", "locks"};
  int contexts = 20;                       // per (family, length)
  uint64_t seed = 1;
  SummaryFormat summary;                   // LOCKS summary format
  std::string out_dir = "eval-out";
};

/// One (context, selector, budget) outcome; `full` runs once per context with budget 0.
struct EvalRow {
  std::string family;
  int length = 0;
  int context = 0;
  uint64_t task_seed = 0;
  std::string selector;
  int budget = 0;
  bool correct = false;               // every answer token of every question right
  int answer_tokens = 0;
  int answer_tokens_correct = 0;
  int64_t decode_steps = 0;
  double bytes_read_per_step = 0;
  double dense_bytes_per_step = 0;
  double read_ratio = 0;              // bytes_read / dense
  int prompt_tokens = 0;
  double decode_seconds = 0;
};

/// Run the grid. Rows are appended to out_dir/results.csv as they finish (an interrupted run keeps
/// them); out_dir/summary.md is written at the end. `progress` (optional) is called after each
/// context. Throws std::invalid_argument for unknown families/selectors or bad budgets, and
/// std::runtime_error for unreadable model/corpus or an unwritable out_dir.
std::vector<EvalRow> run_eval(const EvalConfig& cfg,
                              const std::function<void(int done, int total, const std::string& what)>& progress = {});

/// Markdown accuracy table (rows: selector; columns: budget) per (family, length), with the mean
/// read ratio, from finished rows.
std::string eval_summary_markdown(const EvalConfig& cfg, const std::vector<EvalRow>& rows);

}  // namespace locks
