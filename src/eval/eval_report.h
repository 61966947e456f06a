// Report writers of `locks eval` (internal): SVG plots from finished rows.
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

/// Removes the plots write_eval_plots names from `out_dir` (of any family and length), so that a
/// reused directory holds only this run's. Returns how many were removed; failures are ignored
/// (the writers report an unwritable directory).
int remove_eval_plots(const std::string& out_dir);

}  // namespace locks
