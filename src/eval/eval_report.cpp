// `locks eval`, reporting: results.csv as rows finish, then the Markdown summary, locality.csv and
// the SVG plots.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <stdexcept>
#include <system_error>
#include <tuple>

#include "eval/eval_internal.h"
#include "locks/svg_plot.h"

namespace locks {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

constexpr const char* kCsvHeader =
    "family,length,context,task_seed,selector,budget,correct,answer_tokens,answer_tokens_correct,kl_vs_full,"
    "decode_steps,bytes_read_per_step,dense_bytes_per_step,read_ratio,prompt_tokens,decode_seconds,lse_mae,"
    "logit_mae,spearman,coverage,worst_head_coverage,oracle_coverage,output_rel_err,carrier_retention,"
    "carrier_retention_any,carrier_obs,budget_mean,budget_p50,budget_p95,mass_target_met";

std::string csv_num(double v) { return std::isnan(v) ? "" : fmt::format("{:.6g}", v); }

// Rows of one (family, length, selector, budget); budget-free selectors match every budget.
template <class F>
void for_rows(const std::vector<EvalRow>& rows, const std::string& fam, int len, const std::string& sel, int b, F&& f) {
  for (const auto& r : rows)
    if (r.family == fam && r.length == len && r.selector == sel && (r.budget == 0 || r.budget == b)) f(r);
}

std::string num(double v, int prec = 3) { return std::isnan(v) ? "–" : fmt::format("{:.{}f}", v, prec); }

bool is_retrieval(const std::string& f) { return f != "continuation"; }

// write_eval_plots' files: <dir>/<prefix><family and/or length>.svg.
enum Plot { kAccuracy, kCarrier, kLadder, kLocality, kBytes, kTail };
constexpr std::array<const char*, 6> kPlotPrefixes = {
    "accuracy_vs_budget_", "carrier_retention_vs_budget_", "error_ladder_", "locality_", "accuracy_vs_bytes_", "tail_"};

// The budgets the tables and plots have columns for: --budgets and each adaptive spec's max=.
EvalConfig with_spec_budgets(EvalConfig cfg) {
  for (const auto& label : cfg.selectors) {
    int max_tokens = 0;
    try {
      max_tokens = parse_selector_spec(label, cfg.summary).max_tokens;
    } catch (const std::invalid_argument&) {  // a label of rows read back: no spec to add
    }
    if (max_tokens > 0 && std::find(cfg.budgets.begin(), cfg.budgets.end(), max_tokens) == cfg.budgets.end())
      cfg.budgets.push_back(max_tokens);
  }
  std::sort(cfg.budgets.begin(), cfg.budgets.end());
  return cfg;
}

bool has_rows(const std::vector<EvalRow>& rows, const std::string& fam, int len) {
  return std::any_of(rows.begin(), rows.end(), [&](const EvalRow& r) { return r.family == fam && r.length == len; });
}

// One (selector, budget) over the retrieval families of a length: accuracy and the means of the
// per-row efficiency columns; each budget a selector ran at, in order (a budget-free one once).
struct BudgetPoint {
  std::string selector;
  int budget = 0;
  int n = 0, correct = 0;
  double bytes = 0, ratio = 0, mean = 0, p50 = 0, p95 = 0, met = 0;
  int met_n = 0;
};
std::vector<BudgetPoint> budget_points(const EvalConfig& cfg, const std::vector<EvalRow>& rows, int len) {
  std::vector<BudgetPoint> pts;
  for (const auto& sel : cfg.selectors) {
    std::vector<int> budgets;
    for (const auto& r : rows)
      if (r.length == len && r.selector == sel && is_retrieval(r.family) &&
          std::find(budgets.begin(), budgets.end(), r.budget) == budgets.end())
        budgets.push_back(r.budget);
    std::sort(budgets.begin(), budgets.end());
    for (int b : budgets) {
      BudgetPoint p{sel, b};
      for (const auto& r : rows)
        if (r.length == len && r.selector == sel && r.budget == b && is_retrieval(r.family)) {
          ++p.n;
          p.correct += r.correct;
          p.bytes += r.bytes_read_per_step;
          p.ratio += r.read_ratio;
          p.mean += r.budget_mean;
          p.p50 += r.budget_p50;
          p.p95 += r.budget_p95;
          if (!std::isnan(r.mass_target_met)) p.met += r.mass_target_met, ++p.met_n;
        }
      for (double* v : {&p.bytes, &p.ratio, &p.mean, &p.p50, &p.p95}) *v /= p.n;
      p.met = p.met_n ? p.met / p.met_n : kNaN;
      pts.push_back(p);
    }
  }
  return pts;
}
std::string plot_path(const std::string& dir, Plot plot, const std::string& what) {
  return dir + "/" + kPlotPrefixes[plot] + what + ".svg";
}

}  // namespace

ResultsCsv::ResultsCsv(const std::string& out_dir) : path_(out_dir + "/results.csv") {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (!std::filesystem::is_directory(out_dir))
    throw std::invalid_argument(fmt::format("output directory '{}': {}", out_dir,
                                            std::filesystem::exists(out_dir) ? std::string("not a directory")
                                            : ec                             ? ec.message()
                                                                             : std::string("cannot create it")));
  remove_eval_report(out_dir);  // a reused directory: nothing of the previous run's report
  csv_.open(path_, std::ios::trunc);
  if (!csv_) throw std::runtime_error(fmt::format("cannot write '{}'", path_));
  csv_ << kCsvHeader << "\n";
  flush();
}

void ResultsCsv::flush() {
  if (!(csv_ << std::flush)) throw std::runtime_error(fmt::format("cannot write '{}' (disk full?)", path_));
}

void ResultsCsv::close() {
  csv_.close();
  if (!csv_) throw std::runtime_error(fmt::format("cannot write '{}' (disk full?)", path_));
}

std::string ResultsCsv::csv_row(const EvalRow& r) {
  return fmt::format(
      "{},{},{},{},{},{},{},{},{},{},{},{:.0f},{:.0f},{:.6f},{},{:.4f},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
      r.family, r.length, r.context, r.task_seed, r.selector, r.budget, r.correct ? 1 : 0, r.answer_tokens,
      r.answer_tokens_correct, csv_num(r.kl_vs_full), r.decode_steps, r.bytes_read_per_step, r.dense_bytes_per_step,
      r.read_ratio, r.prompt_tokens, r.decode_seconds, csv_num(r.lse_mae), csv_num(r.logit_mae), csv_num(r.spearman),
      csv_num(r.coverage), csv_num(r.worst_head_coverage), csv_num(r.oracle_coverage), csv_num(r.output_rel_err),
      csv_num(r.carrier_retention), csv_num(r.carrier_retention_any), csv_num(r.carrier_obs), csv_num(r.budget_mean),
      csv_num(r.budget_p50), csv_num(r.budget_p95), csv_num(r.mass_target_met));
}

namespace {

// The tail finding of one length as Markdown: error quantiles, the deciles and the predictors.
std::string tail_markdown(int len, const TailPages& t) {
  const TailSummary ts = summarize_tails(t.pages, t.context);
  const auto& names = tail_property_names();
  std::string out = fmt::format(
      "## tail finding @ {} tokens ({} pages x (layer, KV head) of {} context(s), full attention's decode steps)\n\n"
      "Per-page mean |s_hat - s| (nats): mean {:.4f}, p50 {:.4f}, p90 {:.4f}, p99 {:.4f}, max {:.4f}.\n\n"
      "| error decile (within its layer, KV head) | mean error |",
      len, ts.pages, std::set<int>(t.context.begin(), t.context.end()).size(), ts.err_mean, ts.err_p50, ts.err_p90,
      ts.err_p99, ts.err_max);
  for (const char* n : names) out += fmt::format(" {} pct |", n);
  out += "\n|---|---|";
  for (size_t k = 0; k < names.size(); ++k) out += "---|";
  out += "\n";
  for (size_t dc = 0; dc < 10; ++dc) {
    out += fmt::format("| {} | {} |", dc + 1, num(ts.decile_err[dc], 4));
    for (double v : ts.decile_property_pct[dc]) out += fmt::format(" {} |", num(v));
    out += "\n";
  }
  out += "\n| predictor | Spearman with the error | precision at the top decile (chance 0.100) |\n|---|---|---|\n";
  for (size_t k = 0; k < names.size(); ++k)
    out += fmt::format("| {} | {} | {} |\n", names[k], num(ts.spearman[k]), num(ts.precision_top10[k]));
  return out + "\n";
}

void write_tails_csv(const std::string& dir, const std::map<int, TailPages>& tails) {
  std::string csv = "length,context,layer,kv_head,page,queries,err_mean,err_max";
  for (const char* n : tail_property_names()) csv += fmt::format(",{}", n);
  csv += "\n";
  for (const auto& [len, t] : tails)
    for (size_t i = 0; i < t.pages.size(); ++i) {
      const TailPage& p = t.pages[i];
      csv += fmt::format("{},{},{},{},{},{},{:.6g},{:.6g}", len, t.context[i], p.layer, p.kv_head, p.page, p.queries,
                         p.err_mean, p.err_max);
      for (double v : tail_properties(p)) csv += fmt::format(",{}", csv_num(v));
      csv += "\n";
    }
  write_text_file(dir + "/tails.csv", csv);
}

}  // namespace

void finish_eval_report(const EvalConfig& cfg, ResultsCsv& csv, const std::vector<EvalRow>& rows,
                        const std::map<int, std::vector<LocalityResult>>& locality, const std::vector<int>& loc_ranks,
                        const std::map<int, TailPages>& tails) {
  std::string loc = "length,rank,page_local,sequence,global\n";
  for (const auto& [len, results] : locality) {
    for (size_t k = 0; k < loc_ranks.size(); ++k) {
      const LocalityMean m = mean_locality(results, k);
      loc += fmt::format("{},{},{:.6f},{:.6f},{:.6f}\n", len, loc_ranks[k], m.page_local, m.sequence, m.global);
    }
  }
  write_text_file(cfg.out_dir + "/locality.csv", loc);
  if (!tails.empty()) write_tails_csv(cfg.out_dir, tails);
  csv.close();
  std::string summary = eval_summary_markdown(cfg, rows);
  for (const auto& [len, t] : tails)
    if (!t.pages.empty()) summary += tail_markdown(len, t);
  write_text_file(cfg.out_dir + "/summary.md", summary);
  write_eval_plots(cfg, rows, locality, loc_ranks, tails);
}

std::string eval_summary_markdown(const EvalConfig& given, const std::vector<EvalRow>& rows) {
  const EvalConfig cfg = with_spec_budgets(given);
  std::string out =
      cfg.from_csv.empty()
          ? fmt::format(
                "# locks eval\n\nmodel `{}`, corpus `{}`, {} contexts per (task, length), seed {}, LOCKS base format "
                "{}\n\n",
                cfg.model_path, cfg.corpus_path, cfg.contexts, cfg.seed, cfg.summary.describe())
          : fmt::format("# locks eval\n\nrows read back from `{}`, up to {} contexts per (task, length)\n\n",
                        fmt::join(cfg.from_csv, "`, `"), cfg.contexts);
  for (int len : cfg.lengths) {
    for (const auto& fam : cfg.families) {
      if (!has_rows(rows, fam, len)) continue;  // rows read back of several runs: not every pair ran
      const bool retr = is_retrieval(fam);
      out +=
          retr ? fmt::format("## {} @ {} tokens — accuracy (correct / contexts) and read ratio vs dense\n\n", fam, len)
               : fmt::format(
                     "## continuation @ {} tokens — top-1 agreement with full attention, KL(full‖sel) "
                     "nats/token, read ratio\n\n",
                     len);
      out += "| selector |";
      for (int b : cfg.budgets) out += fmt::format(" b={} |", b);
      out += "\n|---|";
      for (size_t i = 0; i < cfg.budgets.size(); ++i) out += "---|";
      out += "\n";
      for (const auto& sel : cfg.selectors) {
        out += fmt::format("| {} |", sel);
        for (int b : cfg.budgets) {
          int n = 0, ok = 0, tok = 0, tok_ok = 0;
          double ratio = 0, kl = 0;
          for_rows(rows, fam, len, sel, b, [&](const EvalRow& r) {
            ++n;
            ok += r.correct;
            tok += r.answer_tokens;
            tok_ok += r.answer_tokens_correct;
            ratio += r.read_ratio;
            kl += r.kl_vs_full;
          });
          if (!n)
            out += " – |";
          else if (retr)
            out += fmt::format(" {}/{} ({:.0f}%), read {:.3f} |", ok, n, 100.0 * ok / n, ratio / n);
          else
            out +=
                fmt::format(" {:.1f}%, KL {:.4f}, read {:.3f} |", 100.0 * tok_ok / std::max(tok, 1), kl / n, ratio / n);
        }
        out += "\n";
      }
      out += "\n";
    }
    if (const auto pts = budget_points(cfg, rows, len); !pts.empty()) {
      out += fmt::format(
          "## budget per step @ {} tokens (retrieval tasks; tokens kept per (layer, KV head) selection: row means)"
          "\n\n| selector | budget (max) | accuracy | MiB read / step | read ratio | kept mean | kept p50 | kept p95 | "
          "target met |\n|---|---|---|---|---|---|---|---|---|\n",
          len);
      for (const auto& p : pts)
        out += fmt::format("| {} | {} | {}/{} | {:.2f} | {:.3f} | {} | {} | {} | {} |\n", p.selector,
                           p.budget ? std::to_string(p.budget) : std::string("–"), p.correct, p.n, p.bytes / 1048576.0,
                           p.ratio, num(p.mean, 0), num(p.p50, 0), num(p.p95, 0), num(p.met));
      out += "\n";
    }
    // Fidelity chain over the retrieval families, per selector and budget.
    std::vector<std::string> retr_fams;
    for (const auto& f : cfg.families)
      if (is_retrieval(f)) retr_fams.push_back(f);
    if (!cfg.fidelity || retr_fams.empty()) continue;
    out += fmt::format(
        "## fidelity chain @ {} tokens (answer steps of {}; means over (layer, KV head, step))\n\n"
        "| selector | budget | LSE MAE | logit MAE | Spearman | coverage | worst-head cov. | oracle cov. | "
        "carrier kept (≥5% mass) | carrier kept (all) | output rel. err | read ratio |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        len, fmt::join(retr_fams, ", "));
    for (const auto& sel : cfg.selectors) {
      for (int b : cfg.budgets) {
        std::vector<EvalRow> sub;
        for (const auto& f : retr_fams) for_rows(rows, f, len, sel, b, [&](const EvalRow& r) { sub.push_back(r); });
        if (sub.empty() || sub.front().budget == 0) continue;
        auto m = [&](double EvalRow::*field) {
          double s = 0, n = 0;
          for (const auto& r : sub)
            if (!std::isnan(r.*field)) {
              s += r.*field;
              n += 1;
            }
          return n > 0 ? s / n : kNaN;
        };
        // Carrier retention pooled over observations, not averaged per row.
        double kept = 0, obs = 0;
        for (const auto& r : sub)
          if (!std::isnan(r.carrier_retention) && r.carrier_obs > 0) {
            kept += r.carrier_retention * r.carrier_obs;
            obs += r.carrier_obs;
          }
        out += fmt::format(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", sel, b, num(m(&EvalRow::lse_mae)),
            num(m(&EvalRow::logit_mae)), num(m(&EvalRow::spearman)), num(m(&EvalRow::coverage)),
            num(m(&EvalRow::worst_head_coverage)), num(m(&EvalRow::oracle_coverage)),
            obs > 0 ? fmt::format("{:.3f} (n={:.0f})", kept / obs, obs) : "–", num(m(&EvalRow::carrier_retention_any)),
            num(m(&EvalRow::output_rel_err)), num(m(&EvalRow::read_ratio)));
      }
    }
    out += "\n";
  }
  return out;
}

std::vector<EvalRow> read_eval_rows(const std::vector<std::string>& paths) {
  // The columns of kCsvHeader, in order; files of earlier versions end before the budget columns.
  const auto split = [](const std::string& line) {
    std::vector<std::string> f;
    size_t start = 0;
    for (size_t comma; (comma = line.find(',', start)) != std::string::npos; start = comma + 1)
      f.push_back(line.substr(start, comma - start));
    f.push_back(line.substr(start));
    return f;
  };
  const std::vector<std::string> header = split(kCsvHeader);
  const size_t n_old = header.size() - 4;  // before budget_mean, budget_p50, budget_p95, mass_target_met
  std::vector<EvalRow> rows;
  std::map<std::tuple<std::string, int, int, std::string, int>, std::string> seen;  // row key -> where
  for (const std::string& path : paths) {
    if (std::error_code ec; !std::filesystem::is_regular_file(path, ec))
      throw std::runtime_error(fmt::format("'{}' is not a results.csv file", path));
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("cannot read '{}'", path));
    std::string line;
    // Lines as a spreadsheet may have saved them: a UTF-8 BOM, CRLF endings.
    const auto next = [&] {
      if (!std::getline(in, line)) return false;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      return true;
    };
    next();
    if (line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);
    const std::vector<std::string> got = split(line);
    if (!(got == header || (got.size() == n_old && std::equal(got.begin(), got.end(), header.begin()))))
      throw std::runtime_error(fmt::format("'{}': line 1 is not the header of locks eval's results.csv", path));
    for (int ln = 2; next(); ++ln) {
      if (line.empty()) continue;
      const std::vector<std::string> f = split(line);
      try {
        if (f.size() != got.size())
          throw std::invalid_argument(fmt::format("{} fields, expected {}", f.size(), got.size()));
        size_t i = 0;
        const auto str = [&] { return f[i++]; };
        const auto num = [&] {
          const std::string& v = f[i++];
          if (v.empty()) return kNaN;
          size_t used = 0;
          double x = 0;
          try {
            x = std::stod(v, &used);
          } catch (const std::exception&) {
            used = 0;
          }
          if (used != v.size() || used == 0 || !std::isfinite(x))
            throw std::invalid_argument(fmt::format("column {}: '{}' is not a finite number", header[i - 1], v));
          return x;
        };
        const auto integer = [&](double lo, double hi) {
          const double x = num();
          if (!(x >= lo && x <= hi && x == std::floor(x)))
            throw std::invalid_argument(
                fmt::format("column {}: '{}' is not an integer in [{:.0f}, {:.0f}]", header[i - 1], f[i - 1], lo, hi));
          return x;
        };
        constexpr double kInt = 2147483647.0;
        EvalRow r;
        r.family = str();
        r.length = int(integer(0, kInt)), r.context = int(integer(0, kInt));
        {
          const std::string v = str();
          size_t used = 0;
          try {
            r.task_seed = std::stoull(v, &used);
          } catch (const std::exception&) {
            used = 0;
          }
          if (used == 0 || used != v.size() || v[0] == '-')
            throw std::invalid_argument(fmt::format("column task_seed: '{}' is not a seed", v));
        }
        r.selector = str();
        r.budget = int(integer(0, kInt)), r.correct = integer(0, 1) != 0, r.answer_tokens = int(integer(0, kInt));
        r.answer_tokens_correct = int(integer(0, kInt)), r.kl_vs_full = num();
        r.decode_steps = int64_t(integer(0, 9007199254740992.0));
        r.bytes_read_per_step = num(), r.dense_bytes_per_step = num(), r.read_ratio = num();
        r.prompt_tokens = int(integer(0, kInt)), r.decode_seconds = num();
        for (double* v :
             {&r.lse_mae, &r.logit_mae, &r.spearman, &r.coverage, &r.worst_head_coverage, &r.oracle_coverage,
              &r.output_rel_err, &r.carrier_retention, &r.carrier_retention_any, &r.carrier_obs})
          *v = num();
        r.budget_mean = r.budget_p50 = r.budget_p95 = r.mass_target_met = kNaN;
        if (f.size() == header.size())
          for (double* v : {&r.budget_mean, &r.budget_p50, &r.budget_p95, &r.mass_target_met}) *v = num();
        const auto key = std::make_tuple(r.family, r.length, r.context, r.selector, r.budget);
        const std::string where = fmt::format("'{}', line {}", path, ln);
        if (const auto [it, fresh] = seen.emplace(key, where); !fresh)
          throw std::invalid_argument(fmt::format("the row of ({}, {}, context {}, {}, budget {}) is at {} already",
                                                  r.family, r.length, r.context, r.selector, r.budget, it->second));
        rows.push_back(r);
      } catch (const std::exception& e) {
        throw std::runtime_error(fmt::format("'{}', line {}: {}", path, ln, e.what()));
      }
    }
  }
  return rows;
}

EvalConfig report_eval_rows(EvalConfig cfg, const std::vector<EvalRow>& rows) {
  if (rows.empty()) throw std::invalid_argument("no rows to report");
  cfg.families.clear(), cfg.lengths.clear(), cfg.selectors.clear(), cfg.budgets.clear();
  const auto add = [](auto& list, const auto& v) {
    if (std::find(list.begin(), list.end(), v) == list.end()) list.push_back(v);
  };
  std::map<std::tuple<std::string, int, std::string, int>, int> per_cell;
  bool fidelity = false;
  for (const EvalRow& r : rows) {
    add(cfg.families, r.family), add(cfg.lengths, r.length), add(cfg.selectors, r.selector);
    if (r.budget > 0) add(cfg.budgets, r.budget);
    ++per_cell[{r.family, r.length, r.selector, r.budget}];
    fidelity |= !std::isnan(r.lse_mae);
  }
  std::sort(cfg.budgets.begin(), cfg.budgets.end());
  cfg.contexts = 0;
  for (const auto& [cell, n] : per_cell) cfg.contexts = std::max(cfg.contexts, n);
  cfg.fidelity = fidelity;
  ResultsCsv csv(cfg.out_dir);
  for (const EvalRow& r : rows) csv.add(r);
  finish_eval_report(cfg, csv, rows, {}, {}, {});
  return cfg;
}

int remove_eval_report(const std::string& out_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(out_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!it->is_regular_file(ec)) continue;
    if (name == "summary.md" || name == "locality.csv" || name == "tails.csv") {
      stale.push_back(it->path());
      continue;
    }
    if (it->path().extension() != ".svg") continue;
    for (const char* prefix : kPlotPrefixes)
      if (name.rfind(prefix, 0) == 0) {
        stale.push_back(it->path());
        break;
      }
  }
  int removed = 0;
  for (const auto& path : stale) removed += fs::remove(path, ec) ? 1 : 0;
  return removed;
}

void write_eval_plots(const EvalConfig& given, const std::vector<EvalRow>& rows,
                      const std::map<int, std::vector<LocalityResult>>& locality, const std::vector<int>& loc_ranks,
                      const std::map<int, TailPages>& tails) {
  const EvalConfig cfg = with_spec_budgets(given);
  for (const auto& [len, t] : tails) {
    if (t.pages.empty()) continue;
    const TailSummary ts = summarize_tails(t.pages, t.context);
    std::vector<PlotSeries> series;
    for (size_t k = 0; k < tail_property_names().size(); ++k) {
      PlotSeries sr{tail_property_names()[k], {}, {}};
      for (size_t dc = 0; dc < 10; ++dc) sr.x.push_back(double(dc + 1)), sr.y.push_back(ts.decile_property_pct[dc][k]);
      series.push_back(std::move(sr));
    }
    write_text_file(plot_path(cfg.out_dir, kTail, std::to_string(len)),
                    svg_line_chart(fmt::format("page properties by error decile @ {} tokens (0.5 = unrelated)", len),
                                   "decile of the page's summary error within its (layer, KV head)",
                                   "mean percentile of the property", series, false, 0.0, 1.0));
  }
  std::vector<double> xs(cfg.budgets.begin(), cfg.budgets.end());
  for (int len : cfg.lengths) {
    for (const auto& fam : cfg.families) {
      if (!has_rows(rows, fam, len)) continue;
      std::vector<PlotSeries> series;
      for (const auto& sel : cfg.selectors) {
        PlotSeries s{sel, xs, {}};
        for (int b : cfg.budgets) {
          double n = 0, ok = 0;
          for_rows(rows, fam, len, sel, b, [&](const EvalRow& r) {
            n += 1;
            ok +=
                is_retrieval(fam) ? double(r.correct) : double(r.answer_tokens_correct) / std::max(r.answer_tokens, 1);
          });
          s.y.push_back(n > 0 ? 100.0 * ok / n : kNaN);
        }
        series.push_back(std::move(s));
      }
      write_text_file(plot_path(cfg.out_dir, kAccuracy, fmt::format("{}_{}", fam, len)),
                      svg_line_chart(is_retrieval(fam) ? fmt::format("{} @ {} tokens: accuracy", fam, len)
                                                       : fmt::format("continuation @ {} tokens: top-1 agreement", len),
                                     "budget (tokens per KV head)", "%", series, true, 0.0, 100.0));
    }
    // Accuracy against the bytes a decode step reads, every selector and budget (retrieval tasks).
    if (const auto pts = budget_points(cfg, rows, len); !pts.empty()) {
      std::vector<PlotSeries> series;
      for (const auto& p : pts) {
        if (series.empty() || series.back().name != p.selector) series.push_back({p.selector, {}, {}});
        series.back().x.push_back(p.bytes / 1048576.0);
        series.back().y.push_back(100.0 * p.correct / p.n);
      }
      for (auto& sr : series) {  // left to right
        std::vector<size_t> idx(sr.x.size());
        for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
        std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return sr.x[a] < sr.x[b]; });
        PlotSeries o{sr.name, {}, {}};
        for (size_t i : idx) o.x.push_back(sr.x[i]), o.y.push_back(sr.y[i]);
        sr = std::move(o);
      }
      write_text_file(
          plot_path(cfg.out_dir, kBytes, std::to_string(len)),
          svg_line_chart(fmt::format("retrieval accuracy vs bytes read per decode step @ {} tokens", len),
                         "MiB read per decode step (all layers and KV heads)", "%", series, true, 0.0, 100.0));
    }
    if (cfg.fidelity) {
      std::vector<PlotSeries> series;
      for (const auto& sel : cfg.selectors) {
        PlotSeries s{sel, xs, {}};
        for (int b : cfg.budgets) {
          double kept = 0, obs = 0;
          for (const auto& fam : cfg.families)
            if (is_retrieval(fam))
              for_rows(rows, fam, len, sel, b, [&](const EvalRow& r) {
                if (r.budget != 0 && !std::isnan(r.carrier_retention) && r.carrier_obs > 0) {
                  kept += r.carrier_retention * r.carrier_obs;
                  obs += r.carrier_obs;
                }
              });
          s.y.push_back(obs > 0 ? kept / obs : kNaN);
        }
        series.push_back(std::move(s));
      }
      write_text_file(plot_path(cfg.out_dir, kCarrier, std::to_string(len)),
                      svg_line_chart(fmt::format("carrier retention @ {} tokens (carrier >= 5% of mass)", len),
                                     "budget (tokens per KV head)", "fraction of steps kept", series, true, 0.0, 1.0));
      // Error ladder: LSE MAE of each estimating selector at the middle budget.
      const int b = cfg.budgets[cfg.budgets.size() / 2];
      std::vector<BarGroup> groups;
      for (const auto& sel : cfg.selectors) {
        double s = 0, n = 0;
        for (const auto& fam : cfg.families)
          if (is_retrieval(fam))
            for_rows(rows, fam, len, sel, b, [&](const EvalRow& r) {
              if (!std::isnan(r.lse_mae)) {
                s += r.lse_mae;
                n += 1;
              }
            });
        if (n > 0) groups.push_back({sel, {s / n}});
      }
      if (!groups.empty())
        write_text_file(plot_path(cfg.out_dir, kLadder, std::to_string(len)),
                        svg_bar_chart(fmt::format("page log-mass error |s_hat - s| @ {} tokens, budget {}", len, b),
                                      "mean absolute error (nats)", {"LSE MAE"}, groups));
    }
  }
  for (const auto& [len, results] : locality) {
    if (results.empty()) continue;
    std::vector<double> ranks(loc_ranks.begin(), loc_ranks.end());
    PlotSeries pl{"page-local (LOCKS)", {}, {}}, sq{"sequence (ShadowKV scope)", {}, {}},
        gl{"global (Loki scope)", {}, {}};
    for (size_t k = 0; k < loc_ranks.size(); ++k) {
      const LocalityMean m = mean_locality(results, k);
      if (loc_ranks[k] <= 16) {
        pl.x.push_back(ranks[k]);
        pl.y.push_back(m.page_local);
      }
      sq.x.push_back(ranks[k]);
      sq.y.push_back(m.sequence);
      gl.x.push_back(ranks[k]);
      gl.y.push_back(m.global);
    }
    write_text_file(plot_path(cfg.out_dir, kLocality, std::to_string(len)),
                    svg_line_chart(fmt::format("within-page key energy captured at rank r, {} tokens", len),
                                   fmt::format("rank (shared scopes also at matched bytes: rank {})", loc_ranks.back()),
                                   "fraction of energy", {pl, sq, gl}, true, 0.0, 1.0));
  }
}

}  // namespace locks
