#include "locks/eval_runner.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>

#include <fmt/format.h>

#include "locks/model.h"
#include "locks/sampler.h"
#include "locks/selector.h"
#include "locks/session.h"
#include "locks/text_corpus.h"

namespace locks {

namespace {

constexpr const char* kCsvHeader =
    "family,length,context,task_seed,selector,budget,correct,answer_tokens,answer_tokens_correct,decode_steps,"
    "bytes_read_per_step,dense_bytes_per_step,read_ratio,prompt_tokens,decode_seconds";

std::string csv_row(const EvalRow& r) {
  return fmt::format("{},{},{},{},{},{},{},{},{},{},{:.0f},{:.0f},{:.6f},{},{:.4f}", r.family, r.length, r.context,
                     r.task_seed, r.selector, r.budget, r.correct ? 1 : 0, r.answer_tokens, r.answer_tokens_correct,
                     r.decode_steps, r.bytes_read_per_step, r.dense_bytes_per_step, r.read_ratio, r.prompt_tokens,
                     r.decode_seconds);
}

// Questions and answers through decode, teacher-forced: the answer counts as right when the argmax
// at every answer position is the answer token (equivalent to greedy generation reproducing it).
void answer_questions(Session& s, const NeedleTask& task, EvalRow& row) {
  const std::vector<float>* logits = nullptr;
  for (size_t qi = 0; qi < task.questions.size(); ++qi) {
    const NeedleQuestion& q = task.questions[qi];
    for (int32_t t : q.prompt_ids) logits = &s.decode(t);
    for (size_t i = 0; i < q.answer_ids.size(); ++i) {
      row.answer_tokens += 1;
      row.answer_tokens_correct += argmax(*logits) == q.answer_ids[i] ? 1 : 0;
      const bool last = qi + 1 == task.questions.size() && i + 1 == q.answer_ids.size();
      if (!last) logits = &s.decode(q.answer_ids[i]);
    }
  }
  row.correct = row.answer_tokens_correct == row.answer_tokens;
  const DecodeTotals& t = s.totals();
  row.decode_steps = t.steps;
  row.bytes_read_per_step = t.steps ? t.bytes_read / double(t.steps) : 0;
  row.dense_bytes_per_step = t.steps ? t.dense_bytes / double(t.steps) : 0;
  row.read_ratio = row.dense_bytes_per_step > 0 ? row.bytes_read_per_step / row.dense_bytes_per_step : 1.0;
  row.decode_seconds = t.seconds;
}

}  // namespace

std::vector<EvalRow> run_eval(const EvalConfig& cfg,
                              const std::function<void(int, int, const std::string&)>& progress) {
  std::vector<NeedleFamily> families;
  for (const auto& f : cfg.families) families.push_back(parse_needle_family(f));
  const auto known = selector_names();
  for (const auto& s : cfg.selectors)
    if (std::find(known.begin(), known.end(), s) == known.end())
      throw std::invalid_argument(fmt::format("unknown selector '{}'", s));
  for (int b : cfg.budgets)
    if (b < 32 || b % 16 != 0) throw std::invalid_argument(fmt::format("budget {}: must be a multiple of 16, >= 32", b));
  if (cfg.contexts < 1) throw std::invalid_argument("contexts must be >= 1");

  const LlamaModel model = LlamaModel::load(cfg.model_path);
  for (int len : cfg.lengths)
    if (len < 256 || len > model.hp.n_ctx_train)
      throw std::invalid_argument(
          fmt::format("length {} outside [256, {}] (the model's context)", len, model.hp.n_ctx_train));
  const std::vector<std::string> docs = load_documents(cfg.corpus_path);

  std::error_code ec;
  std::filesystem::create_directories(cfg.out_dir, ec);
  const std::string csv_path = cfg.out_dir + "/results.csv";
  std::ofstream csv(csv_path, std::ios::trunc);
  if (!csv) throw std::runtime_error(fmt::format("cannot write '{}'", csv_path));
  csv << kCsvHeader << "\n" << std::flush;

  std::vector<EvalRow> rows;
  const int total = int(families.size() * cfg.lengths.size()) * cfg.contexts;
  int done = 0;
  for (NeedleFamily fam : families) {
    for (int len : cfg.lengths) {
      for (int c = 0; c < cfg.contexts; ++c) {
        const uint64_t task_seed = cfg.seed * 1000003ull + uint64_t(len) * 31ull + uint64_t(fam) * 7919ull + c;
        const NeedleTask task = make_needle_task(docs, model.tokenizer, fam, len, task_seed);
        if (progress) progress(done, total, fmt::format("{} {} ctx {} prefill {} tokens", needle_family_name(fam), len, c, task.context_ids.size()));
        SessionConfig base_cfg;
        base_cfg.n_ctx = task.total_tokens() + 16;
        Session base(model, base_cfg);
        base.prefill(task.context_ids);  // dense prefill, shared by every selector
        for (const auto& sel : cfg.selectors) {
          const std::vector<int> budgets = sel == "full" ? std::vector<int>{0} : cfg.budgets;
          for (int b : budgets) {
            SessionConfig sc;
            sc.selector = sel;
            sc.budget_tokens = b == 0 ? 32 : b;
            sc.selector_opts.summary = cfg.summary;
            Session s = base.fork(sc);
            EvalRow row;
            row.family = needle_family_name(fam);
            row.length = len;
            row.context = c;
            row.task_seed = task_seed;
            row.selector = sel;
            row.budget = b;
            row.prompt_tokens = int(task.context_ids.size());
            answer_questions(s, task, row);
            csv << csv_row(row) << "\n" << std::flush;
            rows.push_back(row);
          }
        }
        ++done;
        if (progress) progress(done, total, fmt::format("{} {} ctx {} done", needle_family_name(fam), len, c));
      }
    }
  }
  std::ofstream md(cfg.out_dir + "/summary.md", std::ios::trunc);
  md << eval_summary_markdown(cfg, rows);
  return rows;
}

std::string eval_summary_markdown(const EvalConfig& cfg, const std::vector<EvalRow>& rows) {
  std::string out = fmt::format("# locks eval\n\nmodel `{}`, corpus `{}`, {} contexts per cell, seed {}, LOCKS {}\n\n",
                                cfg.model_path, cfg.corpus_path, cfg.contexts, cfg.seed, cfg.summary.describe());
  for (const auto& fam : cfg.families) {
    for (int len : cfg.lengths) {
      out += fmt::format("## {} @ {} tokens — accuracy (correct / contexts), mean read ratio vs dense\n\n", fam, len);
      out += "| selector |";
      for (int b : cfg.budgets) out += fmt::format(" b={} |", b);
      out += "\n|---|";
      for (size_t i = 0; i < cfg.budgets.size(); ++i) out += "---|";
      out += "\n";
      for (const auto& sel : cfg.selectors) {
        out += fmt::format("| {} |", sel);
        for (int b : cfg.budgets) {
          int n = 0, ok = 0;
          double ratio = 0;
          for (const auto& r : rows)
            if (r.family == fam && r.length == len && r.selector == sel && (sel == "full" ? r.budget == 0 : r.budget == b)) {
              ++n;
              ok += r.correct;
              ratio += r.read_ratio;
            }
          out += n ? fmt::format(" {}/{} ({:.0f}%), read {:.3f} |", ok, n, 100.0 * ok / n, ratio / n) : " – |";
        }
        out += "\n";
      }
      out += "\n";
    }
  }
  return out;
}

}  // namespace locks
