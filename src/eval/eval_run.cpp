// `locks eval`, running: every selector x budget forks each prefilled context and pushes its
// questions and answers (or the continuation's forced tokens) through decode; rows as they finish.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>

#include "eval/eval_internal.h"
#include "locks/fidelity.h"
#include "locks/sampler.h"
#include "locks/session.h"

namespace locks {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool budget_free(const std::string& name) { return !(selector_inputs(name) & kInputBudget); }

void fill_efficiency(const Session& s, EvalRow& row) {
  const DecodeTotals& t = s.totals();
  row.decode_steps = t.steps;
  row.bytes_read_per_step = t.steps ? t.bytes_read / double(t.steps) : 0;
  row.dense_bytes_per_step = t.steps ? t.dense_bytes / double(t.steps) : 0;
  row.read_ratio = row.dense_bytes_per_step > 0 ? row.bytes_read_per_step / row.dense_bytes_per_step : 1.0;
  row.decode_seconds = t.seconds;
  // Budget per selection, in tokens, from the histogram of pages kept.
  int64_t n = 0;
  double sum = 0;
  for (size_t k = 0; k < t.pages_kept.size(); ++k) n += t.pages_kept[k], sum += double(k) * t.pages_kept[k];
  const double page = n ? double(s.cache().page_size()) : 0.0;  // n > 0 only on the CPU
  auto quantile = [&](double f) {
    int64_t seen = 0;
    for (size_t k = 0; k < t.pages_kept.size(); ++k)
      if ((seen += t.pages_kept[k]) >= int64_t(std::ceil(f * double(n)))) return double(k) * page;
    return kNaN;
  };
  row.budget_mean = n ? sum / double(n) * page : kNaN;
  row.budget_p50 = n ? quantile(0.5) : kNaN;
  row.budget_p95 = n ? quantile(0.95) : kNaN;
  row.mass_target_met = t.mass_target_tried ? double(t.mass_target_met) / double(t.mass_target_tried) : kNaN;
}

void fill_fidelity(const FidelityProbe* probe, EvalRow& row) {
  if (!probe) {
    row.lse_mae = row.logit_mae = row.spearman = row.coverage = row.worst_head_coverage = row.oracle_coverage =
        row.output_rel_err = row.carrier_retention = row.carrier_retention_any = row.carrier_obs = kNaN;
    return;
  }
  const FidelityStats t = probe->total();
  const auto m = t.mean();
  row.lse_mae = m.lse_mae;
  row.logit_mae = m.logit_mae;
  row.spearman = m.spearman;
  row.coverage = m.coverage;
  row.worst_head_coverage = m.worst_head_coverage;
  row.oracle_coverage = m.oracle_coverage;
  row.output_rel_err = m.output_rel_err;
  row.carrier_retention = m.carrier_retention;
  row.carrier_retention_any = m.carrier_retention_any;
  row.carrier_obs = t.carrier_obs;
}

// Questions and answers through decode, teacher-forced: the answer counts as right when the argmax
// at every answer position is the answer token (equivalent to greedy generation reproducing it).
// The probe (if any) observes the answer steps only, with the asked needle's value as carrier.
// Pushes every question and answer through decode, scoring the answers. With `first_only`, also
// fills it as if the task had only its first question (what a run of that task would have done up
// to its end: the state just before the first answer's last token is decoded), so one run serves a
// task and its one-question prefix.
void answer_questions(Session& s, const NeedleTask& task, FidelityProbe* probe, EvalRow& row,
                      EvalRow* first_only = nullptr) {
  const std::vector<float>* logits = nullptr;
  for (size_t qi = 0; qi < task.questions.size(); ++qi) {
    const NeedleQuestion& q = task.questions[qi];
    if (probe) probe->set_enabled(false);
    for (int32_t t : q.prompt_ids) logits = &s.decode(t);
    std::vector<int32_t> carriers;
    for (size_t i = 0; i < q.answer_ids.size(); ++i) carriers.push_back(task.value_pos[q.needle] + int32_t(i));
    if (probe) {
      probe->set_carriers(carriers);
      probe->set_enabled(true);
    }
    for (size_t i = 0; i < q.answer_ids.size(); ++i) {
      row.answer_tokens += 1;
      row.answer_tokens_correct += argmax(*logits) == q.answer_ids[i] ? 1 : 0;
      if (first_only && qi == 0 && i + 1 == q.answer_ids.size()) {
        first_only->answer_tokens = row.answer_tokens;
        first_only->answer_tokens_correct = row.answer_tokens_correct;
        first_only->correct = row.answer_tokens_correct == row.answer_tokens;
        fill_fidelity(probe, *first_only);
        fill_efficiency(s, *first_only);
      }
      const bool last = qi + 1 == task.questions.size() && i + 1 == q.answer_ids.size();
      if (!last) logits = &s.decode(q.answer_ids[i]);
    }
  }
  row.correct = row.answer_tokens_correct == row.answer_tokens;
}

// log-softmax in float64.
std::vector<double> log_softmax(const std::vector<float>& l) {
  const float mx = *std::max_element(l.begin(), l.end());
  double z = 0;
  for (float v : l) z += std::exp(double(v) - mx);
  const double lz = mx + std::log(z);
  std::vector<double> out(l.size());
  for (size_t i = 0; i < l.size(); ++i) out[i] = double(l[i]) - lz;
  return out;
}

SessionConfig fork_config(const SelectorSpec& spec, int b) {
  SessionConfig sc;
  sc.selector = spec.name;
  sc.budget_tokens = b == 0 ? 32 : b;
  sc.selector_opts = spec.opts;
  return sc;
}

// The selector metadata forks of `base` share (CPU; null on the GPU, whose forks build their own).
std::unique_ptr<Selector> prepare(const Session& base, const SessionConfig& sc) {
  return base.device() == Device::kCpu ? base.prepare_selector(sc) : nullptr;
}
Session fork(const Session& base, const SessionConfig& sc, const Selector* prepared) {
  return prepared ? base.fork(sc, *prepared) : base.fork(sc);
}

// The budgets a spec runs at: a budget-free selector (full) once, as budget 0; an adaptive one with
// max= once, at its maximum.
std::vector<int> spec_budgets(const EvalConfig& cfg, const SelectorSpec& spec) {
  if (budget_free(spec.name)) return {0};
  if (spec.max_tokens > 0) return {spec.max_tokens};
  return cfg.budgets;
}

// The state of one run of a plan: the rows so far (also in results.csv) and the locality finding.
struct EvalRun {
  const EvalConfig& cfg;
  const EvalPlan& plan;
  const EvalProgress& progress;
  ResultsCsv& csv;
  int total = 0;  // contexts (a paired context counts as two)
  int done = 0;
  std::vector<EvalRow> rows{};
  std::map<int, std::vector<LocalityResult>> locality{};  // by length
  std::map<int, TailPages> tails{};                       // by length

  void add(const EvalRow& row) {
    csv.add(row);
    rows.push_back(row);
  }
};

// Context c of (len, fam): one prefill, then every (task, selector, budget) as a fork. Forks run
// in parallel, one per core, each single-threaded (nested OpenMP regions inside decode run on one
// thread): a decode step of this small model does not keep two threads busy, two forks do. Rows
// are written in the sequential order.
void run_needle_context(EvalRun& run, int len, NeedleFamily fam, int c) {
  const EvalConfig& cfg = run.cfg;
  const EvalPlan& plan = run.plan;
  const std::vector<NeedleTask> tasks = build_needle_tasks(plan, cfg, len, fam, c);
  const bool paired = plan.share && fam == NeedleFamily::kMultiQuery;
  const NeedleTask& task = tasks.back();  // the one with every question: sizes the context
  if (run.progress)
    run.progress(
        run.done, run.total,
        fmt::format("{} {} ctx {}: prefill {} tokens", needle_family_name(fam), len, c, task.context_ids.size()));
  SessionConfig base_cfg;
  base_cfg.n_ctx = task.total_tokens() + 16;
  base_cfg.device = cfg.device;
  Session base(plan.model, base_cfg);
  base.prefill(task.context_ids);  // dense prefill, shared by every selector
  if (c < cfg.locality_contexts && fam == plan.loc_family)
    run.locality[len].push_back(measure_locality(base.cache(), base.sequence(), plan.loc_ranks, plan.global.get()));
  // Selector metadata is built once per context (it does not depend on the budget or the task) and
  // cloned into the fork of every budget.
  std::vector<std::unique_ptr<Selector>> prepared;
  for (const auto& spec : plan.specs)
    prepared.push_back(prepare(base, fork_config(spec, spec_budgets(cfg, spec).front())));
  struct Job {
    const NeedleTask* task;
    const SelectorSpec* spec;
    const Selector* prepared;
    int budget;
    EvalRow row;
    int prefix = -1;                // multikey row (index into prefix_rows) filled from this run's first question
    std::vector<TailPage> tails{};  // the tail finding, measured on this (full attention) fork
  };
  // The tail finding rides on full attention's decode steps of the task with every question.
  const bool measure_tails = c < cfg.tail_contexts && fam == plan.loc_family;
  // A multikey run is an exact prefix of the multiquery run on its context (same tokens, same
  // decode steps, deterministic), so each multiquery fork also yields the multikey row.
  std::vector<EvalRow> prefix_rows;
  std::vector<Job> jobs;
  for (const auto& t : tasks)
    for (size_t si = 0; si < plan.specs.size(); ++si)
      for (int b : spec_budgets(cfg, plan.specs[si])) {
        EvalRow row;
        row.family = needle_family_name(t.family);
        row.length = len;
        row.context = c;
        row.task_seed = needle_task_seed(cfg, len, fam, c);
        row.prompt_tokens = int(t.context_ids.size());
        row.kl_vs_full = kNaN;  // continuation only
        row.selector = plan.specs[si].label;
        row.budget = b;
        if (paired && &t == &tasks.front()) {
          prefix_rows.push_back(row);
          continue;
        }
        jobs.push_back(Job{&t, &plan.specs[si], prepared[si].get(), b, row});
        if (paired) jobs.back().prefix = int(jobs.size()) - 1;
      }
  std::vector<std::string> errors(jobs.size());
  // Longest first (two questions before one), so the last forks of a context finish together.
  std::vector<int> order(jobs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return jobs[size_t(a)].task->questions.size() > jobs[size_t(b)].task->questions.size();
  });
  const int fork_threads = cfg.fork_threads > 0 ? cfg.fork_threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(fork_threads)
  for (int k = 0; k < int(jobs.size()); ++k) {
    const int i = order[size_t(k)];
    Job& j = jobs[size_t(i)];
    try {
      Session s = fork(base, fork_config(*j.spec, j.budget), j.prepared);
      std::unique_ptr<FidelityProbe> probe;
      std::unique_ptr<TailProbe> tail_probe;
      if (cfg.fidelity && !budget_free(j.spec->name)) {
        probe = std::make_unique<FidelityProbe>();
        s.set_observer(probe.get());
      } else if (measure_tails && j.spec->name == "full" && j.task == &tasks.back()) {
        tail_probe = std::make_unique<TailProbe>(s.cache(), s.sequence(), cfg.summary);
        s.set_observer(tail_probe.get());
      }
      answer_questions(s, *j.task, probe.get(), j.row, j.prefix >= 0 ? &prefix_rows[size_t(j.prefix)] : nullptr);
      fill_fidelity(probe.get(), j.row);
      s.set_observer(nullptr);
      if (tail_probe) j.tails = tail_probe->pages();
      fill_efficiency(s, j.row);
    } catch (const std::exception& e) {
      errors[size_t(i)] = e.what();
    }
  }
  for (const auto& e : errors)
    if (!e.empty()) throw std::runtime_error(e);
  for (const auto& r : prefix_rows) run.add(r);
  for (const auto& j : jobs) {
    run.add(j.row);
    if (j.tails.empty()) continue;
    TailPages& t = run.tails[len];
    t.pages.insert(t.pages.end(), j.tails.begin(), j.tails.end());
    t.context.insert(t.context.end(), j.tails.size(), c);
  }
  run.csv.flush();
  run.done += int(tasks.size());
}

// Continuation context c of length len: the last tokens of held-out text teacher-forced through
// decode after a dense prefill of the rest, each selector's distributions against full attention's.
void run_continuation_context(EvalRun& run, int len, int c) {
  const EvalConfig& cfg = run.cfg;
  const EvalPlan& plan = run.plan;
  const uint64_t task_seed = cfg.seed * 1000003ull + uint64_t(len) * 31ull + 555555ull + c;
  const std::vector<int32_t> ids = make_text_tokens(plan.docs, plan.model.tokenizer, len, task_seed);
  const int n_forced = std::min(cfg.continuation_tokens, len - 2);
  const std::vector<int32_t> prefix(ids.begin(), ids.end() - n_forced), forced(ids.end() - n_forced, ids.end());
  if (run.progress)
    run.progress(run.done, run.total, fmt::format("continuation {} ctx {}: prefill {} tokens", len, c, prefix.size()));
  SessionConfig base_cfg;
  base_cfg.n_ctx = len + 16;
  base_cfg.device = cfg.device;
  Session base(plan.model, base_cfg);
  base.prefill(prefix);
  // Reference distributions: full attention, teacher-forced over the same tokens.
  std::vector<std::vector<double>> ref;
  EvalRow proto;
  proto.family = "continuation";
  proto.length = len;
  proto.context = c;
  proto.task_seed = task_seed;
  proto.prompt_tokens = int(prefix.size());
  auto teacher_force = [&](Session& s, EvalRow& row, bool record) {
    const std::vector<float>* logits = &s.logits();  // the prefill's last: predicts forced[0]
    double kl = 0;
    for (int i = 0; i < n_forced; ++i) {
      const std::vector<double> lp = log_softmax(*logits);
      if (record) {
        ref.push_back(lp);
      } else {
        const auto& rp = ref[size_t(i)];
        double k = 0;
        for (size_t v = 0; v < lp.size(); ++v) k += std::exp(rp[v]) * (rp[v] - lp[v]);
        kl += k;
        const auto a = std::max_element(lp.begin(), lp.end()) - lp.begin();
        const auto b = std::max_element(rp.begin(), rp.end()) - rp.begin();
        row.answer_tokens_correct += a == b ? 1 : 0;
      }
      row.answer_tokens += 1;
      if (i + 1 < n_forced) logits = &s.decode(forced[size_t(i)]);
    }
    row.kl_vs_full = record ? 0.0 : kl / n_forced;
    row.correct = row.answer_tokens_correct == row.answer_tokens;
  };
  for (bool record : {true, false}) {
    for (const auto& spec : plan.specs) {
      if (budget_free(spec.name) != record) continue;
      const std::vector<int> budgets = spec_budgets(cfg, spec);
      const auto prepared = prepare(base, fork_config(spec, budgets.front()));
      for (int b : budgets) {
        Session s = fork(base, fork_config(spec, b), prepared.get());
        EvalRow row = proto;
        row.selector = spec.label;
        row.budget = b;
        teacher_force(s, row, record);
        if (record) {  // full agrees with itself
          row.answer_tokens_correct = row.answer_tokens;
          row.correct = true;
        }
        fill_fidelity(nullptr, row);
        fill_efficiency(s, row);
        run.add(row);
        run.csv.flush();
      }
    }
    if (record && ref.empty()) {  // no `full` in the list: record it anyway as the reference
      Session s = base.fork(SessionConfig{});
      EvalRow tmp = proto;
      teacher_force(s, tmp, true);
    }
  }
  ++run.done;
}

// The configuration as run: on the GPU the fidelity chain and the locality finding (both read the
// CPU's cache) are off, and forks run one at a time (they share the GPU).
EvalConfig effective_config(const EvalConfig& given, const std::function<void(const std::string&)>& warn) {
  EvalConfig cfg = given;
  if (cfg.device != Device::kCuda) return cfg;
  if (cfg.fidelity && warn) warn("--device cuda: no fidelity chain (it reads the KV cache on the CPU)");
  if (cfg.locality_contexts > 0 && warn) warn("--device cuda: no locality finding (it reads the KV cache on the CPU)");
  if (cfg.tail_contexts > 0 && warn) warn("--device cuda: no tail finding (it reads the KV cache on the CPU)");
  cfg.fidelity = false;
  cfg.locality_contexts = 0;
  cfg.tail_contexts = 0;
  cfg.fork_threads = 1;
  return cfg;
}

}  // namespace

std::vector<EvalRow> run_eval(const EvalConfig& given, const EvalProgress& progress,
                              const std::function<void(const std::string&)>& warn) {
  if (const std::string why = device_unavailable(given.device); !why.empty()) throw std::runtime_error(why);
  const EvalConfig cfg = effective_config(given, warn);
  EvalPlan plan = plan_eval(cfg, warn);  // every check before the (long) run starts
  ResultsCsv csv(cfg.out_dir);           // rows go out as they are measured: a long run keeps what it finished
  plan_contexts(plan, cfg, progress);
  EvalRun run{cfg, plan, progress, csv};
  run.total = (int(plan.families.size()) + (plan.continuation ? 1 : 0)) * int(cfg.lengths.size()) * cfg.contexts;
  for (int len : cfg.lengths) {
    for (NeedleFamily fam : plan.families)
      if (!(plan.share && fam == NeedleFamily::kMultiKey))  // multikey runs with multiquery
        for (int c = 0; c < cfg.contexts; ++c) run_needle_context(run, len, fam, c);
    if (plan.continuation)
      for (int c = 0; c < cfg.contexts; ++c) run_continuation_context(run, len, c);
  }
  if (progress) progress(run.done, run.total, "writing the report");
  finish_eval_report(cfg, csv, run.rows, run.locality, plan.loc_ranks, run.tails);
  return run.rows;
}

}  // namespace locks
