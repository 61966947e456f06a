// What the three parts of `locks eval` share (internal): the plan (eval_plan.cpp: checks, the
// corpus split, the contexts), which the run (eval_run.cpp: forks, jobs, rows) executes, and the
// report (eval_report.cpp: results.csv as rows finish, then summary.md, locality.csv, the plots).
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "locks/eval_runner.h"
#include "locks/locality.h"
#include "locks/model.h"
#include "locks/needle_task.h"
#include "locks/shared_basis.h"
#include "locks/tail_finding.h"

namespace locks {

using EvalProgress = std::function<void(int done, int total, const std::string& what)>;

/// Everything run_eval decides before its first context: what runs, on which model and text.
struct EvalPlan {
  std::vector<NeedleFamily> families;               // the retrieval families, in the order given
  bool continuation = false;                        // the continuation task runs too
  bool share = false;                               // multikey asks the first question of multiquery's contexts
  NeedleFamily loc_family = NeedleFamily::kSingle;  // the locality finding uses the first family run
  std::vector<SelectorSpec> specs;                  // cfg.selectors; global_basis set by plan_contexts
  LlamaModel model;
  std::vector<std::string> docs;              // what tasks are built from
  std::vector<std::string> calib_docs;        // every tenth document, held back to calibrate the global basis
  std::vector<int> loc_ranks;                 // ranks the locality finding measures (<= head_dim)
  std::shared_ptr<const GlobalBasis> global;  // when a spec or the locality finding needs it
};

/// The checks, then the model and the corpus (split into task and calibration documents). Throws
/// as run_eval documents; `warn` gets the model's notes.
EvalPlan plan_eval(const EvalConfig& cfg, const std::function<void(const std::string&)>& warn);
/// Calibrates the global basis when a spec or the locality finding needs it, then builds every
/// context once, so that one the model cannot hold fails before hours of the tasks before it.
void plan_contexts(EvalPlan& plan, const EvalConfig& cfg, const EvalProgress& progress);
/// The seed of context `c` of (len, fam).
uint64_t needle_task_seed(const EvalConfig& cfg, int len, NeedleFamily fam, int c);
/// The tasks of context c of (len, fam): one, or with plan.share and multiquery, the multikey task
/// (its first question) then the multiquery task. The last one has every question and sizes the
/// context. Throws std::runtime_error when a corpus line overshoots the length.
std::vector<NeedleTask> build_needle_tasks(const EvalPlan& plan, const EvalConfig& cfg, int len, NeedleFamily fam,
                                           int c);

/// out_dir/results.csv, written as rows finish. A failed write (a full disk) throws instead of
/// leaving a cut-off file behind a success.
class ResultsCsv {
 public:
  /// Creates out_dir (std::invalid_argument when it cannot be a directory), removes a previous
  /// run's report (remove_eval_report) and writes the header.
  explicit ResultsCsv(const std::string& out_dir);
  void add(const EvalRow& row) { csv_ << csv_row(row) << "\n"; }
  /// Throws std::runtime_error when what was added cannot be written.
  void flush();
  void close();

 private:
  static std::string csv_row(const EvalRow& r);
  std::string path_;
  std::ofstream csv_;
};

/// The tail finding's pages of one length, and the context each came from.
struct TailPages {
  std::vector<TailPage> pages;
  std::vector<int> context;
};

/// The end of a run: locality.csv (the finding averaged over the measured contexts of each
/// length), tails.csv (every page measured), results.csv closed, summary.md and the plots.
void finish_eval_report(const EvalConfig& cfg, ResultsCsv& csv, const std::vector<EvalRow>& rows,
                        const std::map<int, std::vector<LocalityResult>>& locality, const std::vector<int>& loc_ranks,
                        const std::map<int, TailPages>& tails);

/// accuracy_vs_budget_<family>_<length>.svg, carrier_retention_vs_budget_<length>.svg,
/// locality_<length>.svg (energy captured vs rank by scope), error_ladder_<length>.svg (LSE MAE by
/// selector at the median budget), accuracy_vs_bytes_<length>.svg (every selector and budget) and
/// tail_<length>.svg (page properties by error decile) into cfg.out_dir.
void write_eval_plots(const EvalConfig& cfg, const std::vector<EvalRow>& rows,
                      const std::map<int, std::vector<LocalityResult>>& locality, const std::vector<int>& loc_ranks,
                      const std::map<int, TailPages>& tails);

/// Removes a previous run's report from `out_dir`: summary.md, locality.csv, tails.csv and the plots
/// write_eval_plots names (of any family and length; other files stay), so that a reused directory,
/// even after an interrupted run, never mixes two runs. Returns how many files were removed;
/// failures are ignored (the writers report an unwritable directory).
int remove_eval_report(const std::string& out_dir);

}  // namespace locks
