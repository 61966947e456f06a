// Internal to locks::eval: what eval_run.cpp and eval_report.cpp share (the report writers).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "locks/eval_runner.h"
#include "locks/locality.h"

namespace locks {

/// accuracy_vs_budget_<family>_<length>.svg, carrier_retention_vs_budget_<length>.svg,
/// locality_<length>.svg (energy captured vs rank by scope) and error_ladder_<length>.svg
/// (LSE MAE by selector at the median budget) into cfg.out_dir.
void write_eval_plots(const EvalConfig& cfg, const std::vector<EvalRow>& rows,
                      const std::map<int, std::vector<LocalityResult>>& locality, const std::vector<int>& loc_ranks);

/// Removes a previous run's report from `out_dir`: summary.md, locality.csv and the plots
/// write_eval_plots names (of any family and length; other files stay), so that a reused directory,
/// even after an interrupted run, never mixes two runs. Returns how many files were removed;
/// failures are ignored (the writers report an unwritable directory).
int remove_eval_report(const std::string& out_dir);

}  // namespace locks
