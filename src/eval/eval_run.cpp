#include "locks/eval_runner.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>

#include "eval/eval_internal.h"
#include "locks/fidelity.h"
#include "locks/locality.h"
#include "locks/model.h"
#include "locks/sampler.h"
#include "locks/session.h"
#include "locks/shared_basis.h"
#include "locks/svg_plot.h"
#include "locks/text_corpus.h"

namespace locks {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

constexpr const char* kCsvHeader =
    "family,length,context,task_seed,selector,budget,correct,answer_tokens,answer_tokens_correct,kl_vs_full,"
    "decode_steps,bytes_read_per_step,dense_bytes_per_step,read_ratio,prompt_tokens,decode_seconds,lse_mae,"
    "logit_mae,spearman,coverage,worst_head_coverage,oracle_coverage,output_rel_err,carrier_retention,"
    "carrier_retention_any,carrier_obs";

std::string csv_num(double v) { return std::isnan(v) ? "" : fmt::format("{:.6g}", v); }

std::string csv_row(const EvalRow& r) {
  return fmt::format("{},{},{},{},{},{},{},{},{},{},{},{:.0f},{:.0f},{:.6f},{},{:.4f},{},{},{},{},{},{},{},{},{},{}",
                     r.family, r.length, r.context, r.task_seed, r.selector, r.budget, r.correct ? 1 : 0,
                     r.answer_tokens, r.answer_tokens_correct, csv_num(r.kl_vs_full), r.decode_steps,
                     r.bytes_read_per_step, r.dense_bytes_per_step, r.read_ratio, r.prompt_tokens, r.decode_seconds,
                     csv_num(r.lse_mae), csv_num(r.logit_mae), csv_num(r.spearman), csv_num(r.coverage),
                     csv_num(r.worst_head_coverage), csv_num(r.oracle_coverage), csv_num(r.output_rel_err),
                     csv_num(r.carrier_retention), csv_num(r.carrier_retention_any), csv_num(r.carrier_obs));
}

bool budget_free(const std::string& name) { return !(selector_inputs(name) & kInputBudget); }

void fill_efficiency(const Session& s, EvalRow& row) {
  const DecodeTotals& t = s.totals();
  row.decode_steps = t.steps;
  row.bytes_read_per_step = t.steps ? t.bytes_read / double(t.steps) : 0;
  row.dense_bytes_per_step = t.steps ? t.dense_bytes / double(t.steps) : 0;
  row.read_ratio = row.dense_bytes_per_step > 0 ? row.bytes_read_per_step / row.dense_bytes_per_step : 1.0;
  row.decode_seconds = t.seconds;
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

template <class F>
double mean_of(const std::vector<EvalRow>& rows, F&& pick) {
  double s = 0, n = 0;
  for (const auto& r : rows) {
    const double v = pick(r);
    if (!std::isnan(v)) {
      s += v;
      n += 1;
    }
  }
  return n > 0 ? s / n : kNaN;
}

// The SelectorOptions input that spec key `k` sets (0 for an unknown key, refused by the parser).
unsigned spec_key_input(const std::string& k) {
  if (k == "r") return kInputRank;
  if (k == "basis") return kInputBasisBits;
  if (k == "coef") return kInputCoefBits;
  if (k == "centroid") return kInputCentroidBits;
  if (k == "rule") return kInputGroupRule;
  if (k == "rho") return kInputSharedRank;
  return 0;
}
}  // namespace

SelectorSpec parse_selector_spec(const std::string& spec, const SummaryFormat& base) {
  SelectorSpec s;
  s.label = spec;
  s.opts.summary = base;
  size_t start = 0;
  bool first = true;
  std::vector<std::string> seen_keys;  // a key given twice would silently keep the last value
  while (start <= spec.size()) {
    size_t end = spec.find('/', start);
    if (end == std::string::npos) end = spec.size();
    const std::string part = spec.substr(start, end - start);
    if (first) {
      if (part.empty()) throw std::invalid_argument(fmt::format("selector '{}': empty selector name", spec));
      s.name = part;
      if (const auto known = selector_names(); std::find(known.begin(), known.end(), s.name) == known.end())
        throw std::invalid_argument(fmt::format("unknown selector '{}' in '{}'", s.name, spec));
      first = false;
    } else {
      const size_t eq = part.find('=');
      if (eq == std::string::npos)
        throw std::invalid_argument(fmt::format("selector '{}': '{}' is not key=value", spec, part));
      const std::string k = part.substr(0, eq), v = part.substr(eq + 1);
      if (std::find(seen_keys.begin(), seen_keys.end(), k) != seen_keys.end())
        throw std::invalid_argument(fmt::format("selector '{}': key '{}' given twice", spec, k));
      seen_keys.push_back(k);
      auto as_int = [&] {
        try {
          size_t used = 0;
          const int x = std::stoi(v, &used);
          if (used != v.size()) throw std::invalid_argument("trailing");
          return x;
        } catch (const std::exception&) {
          throw std::invalid_argument(fmt::format("selector '{}': {}='{}' is not an integer", spec, k, v));
        }
      };
      // Each key only where the selector reads that option (the selector table): a key another
      // selector ignores would only mislabel its rows.
      if (const unsigned input = spec_key_input(k); input != 0 && !(selector_inputs(s.name) & input))
        throw std::invalid_argument(fmt::format("selector '{}': key '{}' does not apply to {}", spec, k, s.name));
      if (k == "r")
        s.opts.summary.rank = as_int();
      else if (k == "basis")
        s.opts.summary.basis_bits = as_int();
      else if (k == "coef")
        s.opts.summary.coef_bits = as_int();
      else if (k == "centroid")
        s.opts.summary.centroid_bits = as_int();
      else if (k == "rho")
        s.opts.shared_rank = as_int();
      else if (k == "rule")
        try {
          s.opts.group_rule = parse_group_rule(v);
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument(fmt::format("selector '{}': {}", spec, e.what()));
        }
      else
        throw std::invalid_argument(
            fmt::format("selector '{}': unknown key '{}' (r, basis, coef, centroid, rule, rho)", spec, k));
    }
    start = end + 1;
  }
  return s;
}

void check_eval_config(const EvalConfig& cfg) {
  bool continuation = false;
  for (const auto& f : cfg.families) {
    if (f == "continuation")
      continuation = true;
    else
      parse_needle_family(f);
  }
  for (const auto& s : cfg.selectors) parse_selector_spec(s, cfg.summary);
  for (int b : cfg.budgets)
    if (b < 32 || b % 16 != 0)
      throw std::invalid_argument(fmt::format("budget {}: must be a multiple of 16, >= 32", b));
  if (cfg.contexts < 1) throw std::invalid_argument("contexts must be >= 1");
  if (cfg.continuation_tokens < 1) throw std::invalid_argument("continuation tokens must be >= 1");
  for (int len : cfg.lengths) {
    if (len < 256 || len > kMaxContextTokens)
      throw std::invalid_argument(fmt::format("length {}: must be in [256, {}] tokens", len, kMaxContextTokens));
    if (continuation && cfg.continuation_tokens > len / 2)
      throw std::invalid_argument(fmt::format(
          "continuation tokens {} are more than half of the length {}: the prefix the selectors work on would "
          "be shorter than the forced tokens",
          cfg.continuation_tokens, len));
  }
}

std::vector<EvalRow> run_eval(const EvalConfig& cfg,
                              const std::function<void(int, int, const std::string&)>& progress,
                              const std::function<void(const std::string&)>& warn) {
  // Validate everything before the (long) run starts.
  check_eval_config(cfg);
  bool continuation = false;
  std::vector<NeedleFamily> families;
  for (const auto& f : cfg.families) {
    if (f == "continuation")
      continuation = true;
    else
      families.push_back(parse_needle_family(f));
  }
  std::vector<SelectorSpec> specs;
  for (const auto& s : cfg.selectors) specs.push_back(parse_selector_spec(s, cfg.summary));

  const LlamaModel model = LlamaModel::load(cfg.model_path);
  if (warn)
    for (const std::string& n : model.defaults_used) warn(n);
  for (int len : cfg.lengths)
    if (len > model.hp.n_ctx_train)
      throw std::invalid_argument(
          model.hp.n_ctx_train < 256
              ? fmt::format("the model's context of {} tokens is shorter than eval's shortest length, 256",
                            model.hp.n_ctx_train)
              : fmt::format("length {} is longer than the model's context of {} tokens", len, model.hp.n_ctx_train));
  for (const auto& s : specs) {
    KvCacheConfig probe_cfg{model.hp.n_layer, model.hp.n_head_kv, model.hp.head_dim, 16, 1, KvDtype::F16};
    // Throws on bad variants (global-basis waits for the basis calibrated below).
    if (!(selector_inputs(s.name) & kInputGlobalBasis)) make_selector(s.name, probe_cfg, s.opts);
  }
  const std::vector<std::string> all_docs = load_documents(cfg.corpus_path);
  // Every tenth document is reserved for calibration (the global basis is fit on other text).
  std::vector<std::string> calib_docs, docs;
  for (size_t i = 0; i < all_docs.size(); ++i) (i % 10 == 0 ? calib_docs : docs).push_back(all_docs[i]);
  if (docs.empty())
    throw std::invalid_argument(fmt::format(
        "corpus '{}' holds {} document(s); eval needs at least 2 (every tenth, starting with the first, is held "
        "back to calibrate the global basis; documents are separated by the byte 0x1E)",
        cfg.corpus_path, all_docs.size()));
  if (calib_docs.empty()) calib_docs = docs;

  std::error_code ec;
  std::filesystem::create_directories(cfg.out_dir, ec);
  if (!std::filesystem::is_directory(cfg.out_dir))
    throw std::invalid_argument(fmt::format("output directory '{}': {}", cfg.out_dir,
                                            std::filesystem::exists(cfg.out_dir) ? std::string("not a directory")
                                            : ec                                 ? ec.message()
                                                                                 : std::string("cannot create it")));
  remove_eval_report(cfg.out_dir);  // a reused directory: nothing of the previous run's report
  const std::string csv_path = cfg.out_dir + "/results.csv";
  std::ofstream csv(csv_path, std::ios::trunc);
  if (!csv) throw std::runtime_error(fmt::format("cannot write '{}'", csv_path));
  // Rows go out as they are measured (a long run keeps what it finished); a failed write (a full
  // disk) stops the run instead of leaving a cut-off file behind a success.
  auto flush_csv = [&] {
    if (!(csv << std::flush)) throw std::runtime_error(fmt::format("cannot write '{}' (disk full?)", csv_path));
  };
  csv << kCsvHeader << "\n";
  flush_csv();

  // Loki's scope: one basis per (layer, KV head) from a dense prefill of calibration text.
  std::shared_ptr<const GlobalBasis> global;
  {
    const bool need = std::any_of(specs.begin(), specs.end(),
                                  [](const auto& s) { return selector_inputs(s.name) & kInputGlobalBasis; });
    if (need || cfg.locality_contexts > 0) {
      if (progress) progress(0, 1, "calibrating the global basis on 4096 tokens of other text");
      std::vector<int32_t> ids;
      try {
        ids = make_text_tokens(calib_docs, model.tokenizer, 4096, cfg.seed + 4242);
      } catch (const std::invalid_argument& e) {  // say what the 4096 tokens are for
        throw std::invalid_argument(fmt::format(
            "calibrating the global basis ({}) on 4096 tokens of the corpus's held-back documents (every tenth): "
            "{}",
            need ? "the global-basis selector" : "--locality-contexts", e.what()));
      }
      SessionConfig sc;
      sc.n_ctx = 4096;
      Session cal(model, sc);
      cal.prefill(ids);
      global = std::make_shared<GlobalBasis>(calibrate_global_basis(cal.cache(), cal.sequence(), model.hp.head_dim));
    }
    for (auto& s : specs) s.opts.global_basis = global;
  }

  std::vector<EvalRow> rows;
  const int n_fam = int(families.size()) + (continuation ? 1 : 0);
  const int total = n_fam * int(cfg.lengths.size()) * cfg.contexts;
  int done = 0;
  const int matched_rho = matched_bytes_rank(cfg.summary, 16, model.hp.head_dim);
  std::vector<int> loc_ranks;  // ranks above head_dim do not exist (tiny models: head_dim 8)
  for (int r : {1, 2, 4, 8, 16, matched_rho})
    if (r <= model.hp.head_dim && std::find(loc_ranks.begin(), loc_ranks.end(), r) == loc_ranks.end())
      loc_ranks.push_back(r);
  std::map<int, std::vector<LocalityResult>> locality;  // by length

  auto fork_config = [](const SelectorSpec& spec, int b) {
    SessionConfig sc;
    sc.selector = spec.name;
    sc.budget_tokens = b == 0 ? 32 : b;
    sc.selector_opts = spec.opts;
    return sc;
  };
  // One selector per spec with its metadata built on the context once (it does not depend on the
  // budget), cloned into the fork of every budget.
  auto run_config = [&](const SelectorSpec& spec, int b, const Session& base, const Selector& prepared, EvalRow row,
                        auto&& body) {
    Session s = base.fork(fork_config(spec, b), prepared);
    row.selector = spec.label;
    row.budget = b;
    body(s, row);
    fill_efficiency(s, row);
    csv << csv_row(row) << "\n";
    flush_csv();
    rows.push_back(row);
  };

  // multikey asks the first question of a multiquery context (four needles either way), so with
  // both families one prefill serves two tasks: paired contexts, a third fewer prefills.
  const auto has = [&](NeedleFamily f) { return std::find(families.begin(), families.end(), f) != families.end(); };
  const bool share = cfg.share_contexts && has(NeedleFamily::kMultiKey) && has(NeedleFamily::kMultiQuery);
  // Forks of one context run in parallel, one per core, each single-threaded (nested OpenMP
  // regions inside decode run on one thread): a decode step of this small model does not keep two
  // threads busy, two forks do. Rows are written in the sequential order.
  struct Job {
    const NeedleTask* task;
    const SelectorSpec* spec;
    const Selector* prepared;
    int budget;
    EvalRow row;
    int prefix = -1;  // multikey row (index into prefix_rows) filled from this run's first question
  };

  const int fork_threads = cfg.fork_threads > 0 ? cfg.fork_threads : omp_get_max_threads();
  NeedleFamily loc_family = NeedleFamily::kSingle;  // the locality finding uses the first family run
  for (NeedleFamily f : families)
    if (!(share && f == NeedleFamily::kMultiKey)) {
      loc_family = f;
      break;
    }

  auto task_seed_of = [&](int len, NeedleFamily fam, int c) {
    return cfg.seed * 1000003ull + uint64_t(len) * 31ull + uint64_t(fam) * 7919ull + uint64_t(c);
  };
  // The tasks of context c of (length, family); the last one has every question and sizes the context.
  auto build_tasks = [&](int len, NeedleFamily fam, int c) {
    const uint64_t task_seed = task_seed_of(len, fam, c);
    std::vector<NeedleTask> tasks;
    tasks.push_back(make_needle_task(docs, model.tokenizer, fam, len, task_seed));
    if (share && fam == NeedleFamily::kMultiQuery) {  // multikey: the same context, its first question only
      NeedleTask mk = tasks.front();
      mk.family = NeedleFamily::kMultiKey;
      mk.questions.resize(1);
      tasks.insert(tasks.begin(), std::move(mk));
    }
    // The builder adds whole corpus lines; one line longer than the length overshoots it.
    const NeedleTask& task = tasks.back();
    if (task.total_tokens() > len + 64 || task.total_tokens() > model.hp.n_ctx_train)
      throw std::runtime_error(fmt::format(
          "{} context {} has {} tokens for length {} (model context {}): a corpus line is longer than the length",
          needle_family_name(fam), c, task.total_tokens(), len, model.hp.n_ctx_train));
    return tasks;
  };
  // Every context is built (tokenized) once before the run, so that one the model cannot hold fails
  // now, not after hours of the tasks before it.
  for (int len : cfg.lengths)
    for (NeedleFamily fam : families)
      if (!(share && fam == NeedleFamily::kMultiKey))
        for (int c = 0; c < cfg.contexts; ++c) (void)build_tasks(len, fam, c);

  for (int len : cfg.lengths) {
    for (NeedleFamily fam : families) {
      if (share && fam == NeedleFamily::kMultiKey) continue;  // runs with multiquery
      for (int c = 0; c < cfg.contexts; ++c) {
        const uint64_t task_seed = task_seed_of(len, fam, c);
        std::vector<NeedleTask> tasks = build_tasks(len, fam, c);
        const bool paired = share && fam == NeedleFamily::kMultiQuery;
        const NeedleTask& task = tasks.back();  // the one with every question: sizes the context
        if (progress)
          progress(
              done, total,
              fmt::format("{} {} ctx {}: prefill {} tokens", needle_family_name(fam), len, c, task.context_ids.size()));
        SessionConfig base_cfg;
        base_cfg.n_ctx = task.total_tokens() + 16;
        Session base(model, base_cfg);
        base.prefill(task.context_ids);  // dense prefill, shared by every selector
        if (c < cfg.locality_contexts && fam == loc_family)
          locality[len].push_back(measure_locality(base.cache(), base.sequence(), loc_ranks, global.get()));
        // Selector metadata is built once per context (it does not depend on the budget or the task).
        std::vector<std::unique_ptr<Selector>> prepared;
        std::vector<Job> jobs;
        for (const auto& spec : specs) {
          const std::vector<int> budgets = budget_free(spec.name) ? std::vector<int>{0} : cfg.budgets;
          prepared.push_back(base.prepare_selector(fork_config(spec, budgets.front())));
        }
        // A multikey run is an exact prefix of the multiquery run on its context (same tokens, same
        // decode steps, deterministic), so each multiquery fork also yields the multikey row.
        std::vector<EvalRow> prefix_rows;
        for (const auto& t : tasks)
          for (size_t si = 0; si < specs.size(); ++si)
            for (int b : budget_free(specs[si].name) ? std::vector<int>{0} : cfg.budgets) {
              EvalRow row;
              row.family = needle_family_name(t.family);
              row.length = len;
              row.context = c;
              row.task_seed = task_seed;
              row.prompt_tokens = int(t.context_ids.size());
              row.kl_vs_full = kNaN;  // continuation only
              row.selector = specs[si].label;
              row.budget = b;
              if (paired && &t == &tasks.front()) {
                prefix_rows.push_back(row);
                continue;
              }
              jobs.push_back(Job{&t, &specs[si], prepared[si].get(), b, row});
              if (paired) jobs.back().prefix = int(jobs.size()) - 1;
            }
        std::vector<std::string> errors(jobs.size());
        // Longest first (two questions before one), so the last forks of a context finish together.
        std::vector<int> order(jobs.size());
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
          return jobs[size_t(a)].task->questions.size() > jobs[size_t(b)].task->questions.size();
        });
#pragma omp parallel for schedule(dynamic, 1) num_threads(fork_threads)
        for (int k = 0; k < int(jobs.size()); ++k) {
          const int i = order[size_t(k)];
          Job& j = jobs[size_t(i)];
          try {
            Session s = base.fork(fork_config(*j.spec, j.budget), *j.prepared);
            std::unique_ptr<FidelityProbe> probe;
            if (cfg.fidelity && !budget_free(j.spec->name)) {
              probe = std::make_unique<FidelityProbe>();
              s.set_observer(probe.get());
            }
            answer_questions(s, *j.task, probe.get(), j.row, j.prefix >= 0 ? &prefix_rows[size_t(j.prefix)] : nullptr);
            fill_fidelity(probe.get(), j.row);
            s.set_observer(nullptr);
            fill_efficiency(s, j.row);
          } catch (const std::exception& e) {
            errors[size_t(i)] = e.what();
          }
        }
        for (const auto& e : errors)
          if (!e.empty()) throw std::runtime_error(e);
        for (const auto& r : prefix_rows) {
          csv << csv_row(r) << "\n";
          rows.push_back(r);
        }
        for (const auto& j : jobs) {
          csv << csv_row(j.row) << "\n";
          rows.push_back(j.row);
        }
        flush_csv();
        done += int(tasks.size());
      }
    }
    if (continuation) {
      for (int c = 0; c < cfg.contexts; ++c) {
        const uint64_t task_seed = cfg.seed * 1000003ull + uint64_t(len) * 31ull + 555555ull + c;
        const std::vector<int32_t> ids = make_text_tokens(docs, model.tokenizer, len, task_seed);
        const int n_forced = std::min(cfg.continuation_tokens, len - 2);
        const std::vector<int32_t> prefix(ids.begin(), ids.end() - n_forced), forced(ids.end() - n_forced, ids.end());
        if (progress)
          progress(done, total, fmt::format("continuation {} ctx {}: prefill {} tokens", len, c, prefix.size()));
        SessionConfig base_cfg;
        base_cfg.n_ctx = len + 16;
        Session base(model, base_cfg);
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
          for (const auto& spec : specs) {
            if (budget_free(spec.name) != record) continue;
            const std::vector<int> budgets = budget_free(spec.name) ? std::vector<int>{0} : cfg.budgets;
            const auto prepared = base.prepare_selector(fork_config(spec, budgets.front()));
            for (int b : budgets)
              run_config(spec, b, base, *prepared, proto, [&](Session& s, EvalRow& row) {
                teacher_force(s, row, record);
                if (record) {  // full agrees with itself
                  row.answer_tokens_correct = row.answer_tokens;
                  row.correct = true;
                }
                fill_fidelity(nullptr, row);
              });
          }
          if (record && ref.empty()) {  // no `full` in the list: record it anyway as the reference
            Session s = base.fork(SessionConfig{});
            EvalRow tmp = proto;
            teacher_force(s, tmp, true);
          }
        }
        ++done;
      }
    }
  }
  if (progress) progress(done, total, "writing the report");

  // Locality finding (averaged over the measured contexts of each length).
  {
    std::string loc = "length,rank,page_local,sequence,global\n";
    for (const auto& [len, results] : locality) {
      for (size_t k = 0; k < loc_ranks.size(); ++k) {
        const LocalityMean m = mean_locality(results, k);
        loc += fmt::format("{},{},{:.6f},{:.6f},{:.6f}\n", len, loc_ranks[k], m.page_local, m.sequence, m.global);
      }
    }
    write_text_file(cfg.out_dir + "/locality.csv", loc);
  }
  csv.close();
  if (!csv) throw std::runtime_error(fmt::format("cannot write '{}' (disk full?)", csv_path));
  write_text_file(cfg.out_dir + "/summary.md", eval_summary_markdown(cfg, rows));
  write_eval_plots(cfg, rows, locality, loc_ranks);
  return rows;
}

}  // namespace locks
