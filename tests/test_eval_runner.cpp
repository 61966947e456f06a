// `locks eval` on the reference model at a short length: the shortcuts the runner takes for speed
// (forks of a context in parallel; multikey read off the multiquery run on a shared context) must
// give exactly what a plain run gives.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "eval/eval_internal.h"
#include "locks/eval_runner.h"
#include "locks/model.h"
#include "locks/needle_task.h"
#include "locks/session.h"
#include "locks/svg_plot.h"
#include "locks/text_corpus.h"
#include "test_paths.h"
#include "test_util.h"

namespace {

using namespace locks;

EvalConfig small_config(const std::string& out) {
  EvalConfig c;
  c.model_path = test::source_path("models/locks-ref-a-q8_0.gguf");
  c.corpus_path = test::shared_path("data/heldout-text.txt.xz");
  c.families = {"multikey", "multiquery"};
  c.lengths = {512};
  c.budgets = {32, 64};
  c.selectors = {"full", "locks", "oracle", "quest"};
  c.contexts = 1;
  c.seed = 7;
  c.locality_contexts = 0;
  c.out_dir = (std::filesystem::temp_directory_path() / out).string();
  return c;
}

// Every column but the wall-clock one, as the CSV writes it.
void expect_same_rows(const std::vector<EvalRow>& a, const std::vector<EvalRow>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].family + " " + a[i].selector + " " + std::to_string(a[i].budget));
    EXPECT_EQ(a[i].family, b[i].family);
    EXPECT_EQ(a[i].selector, b[i].selector);
    EXPECT_EQ(a[i].budget, b[i].budget);
    EXPECT_EQ(a[i].task_seed, b[i].task_seed);
    EXPECT_EQ(a[i].correct, b[i].correct);
    EXPECT_EQ(a[i].answer_tokens_correct, b[i].answer_tokens_correct);
    EXPECT_EQ(a[i].decode_steps, b[i].decode_steps);
    EXPECT_EQ(a[i].bytes_read_per_step, b[i].bytes_read_per_step);
    for (auto [x, y] : {std::pair{a[i].lse_mae, b[i].lse_mae},
                        {a[i].coverage, b[i].coverage},
                        {a[i].output_rel_err, b[i].output_rel_err},
                        {a[i].carrier_retention_any, b[i].carrier_retention_any}})
      EXPECT_TRUE(x == y || (std::isnan(x) && std::isnan(y))) << x << " vs " << y;
  }
}

// Forks one after another vs two at a time (same prefill: the thread count changes Eigen's GEMM
// blocking, so it is kept at two for both runs; every fork decodes on one thread either way).
TEST(EvalRunner, ParallelForksGiveTheRowsOfSequentialForks) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  EvalConfig seq = small_config("locks-eval-t1"), par = small_config("locks-eval-t2");
  seq.fork_threads = 1;
  par.fork_threads = 2;
  const auto one = run_eval(seq, nullptr);
  const auto two = run_eval(par, nullptr);
  omp_set_num_threads(saved);
  expect_same_rows(one, two);
}

// The multikey rows of a shared-context run against an independent run of that task: the same
// context (the multiquery task of the row's seed), only its first question, through a plain fork.
TEST(EvalRunner, MultikeyRowsEqualARunOfTheFirstQuestionAlone) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  const EvalConfig cfg = small_config("locks-eval-shared");
  const auto rows = run_eval(cfg, nullptr);
  const LlamaModel model = LlamaModel::load(cfg.model_path);
  const auto all_docs = load_documents(cfg.corpus_path);
  std::vector<std::string> docs;  // the runner's split: every tenth document is held back
  for (size_t i = 0; i < all_docs.size(); ++i)
    if (i % 10 != 0) docs.push_back(all_docs[i]);
  int checked = 0;
  for (const EvalRow& r : rows) {
    if (r.family != "multikey") continue;
    NeedleTask task = make_needle_task(docs, model.tokenizer, NeedleFamily::kMultiQuery, r.length, r.task_seed);
    ASSERT_EQ(task.questions.size(), 2u);
    SessionConfig base_cfg;
    base_cfg.n_ctx = task.total_tokens() + 16;
    Session base(model, base_cfg);
    base.prefill(task.context_ids);
    SessionConfig fc;
    fc.selector = r.selector;
    fc.budget_tokens = r.budget == 0 ? 32 : r.budget;
    Session s = base.fork(fc);
    const NeedleQuestion& q = task.questions.front();
    const std::vector<float>* logits = nullptr;
    for (int32_t t : q.prompt_ids) logits = &s.decode(t);
    int right = 0;
    for (size_t i = 0; i < q.answer_ids.size(); ++i) {
      right += int(std::max_element(logits->begin(), logits->end()) - logits->begin()) == q.answer_ids[i];
      if (i + 1 < q.answer_ids.size()) logits = &s.decode(q.answer_ids[i]);
    }
    SCOPED_TRACE(r.selector + " " + std::to_string(r.budget));
    EXPECT_EQ(r.answer_tokens, int(q.answer_ids.size()));
    EXPECT_EQ(r.answer_tokens_correct, right);
    EXPECT_EQ(r.decode_steps, s.totals().steps);
    EXPECT_DOUBLE_EQ(r.bytes_read_per_step, s.totals().bytes_read / double(s.totals().steps));
    ++checked;
  }
  EXPECT_EQ(checked, 1 + 3 * 2);  // full once; locks, oracle and quest at two budgets
}

// The adaptive budget and rank rules through the harness, the tail finding on full attention's
// steps, and the report read back from results.csv.
TEST(EvalRunner, AdaptiveRowsTailsAndTheReportReadBack) {
  if (!test::shared_available()) GTEST_SKIP() << "../shared not present";
  EvalConfig cfg = small_config("locks-eval-adaptive");
  cfg.families = {"multikey"};
  cfg.selectors = {"full", "locks", "locks/p=0.5/max=64", "locks/cert=0.5/max=64", "locks/bytes=0.7"};
  cfg.tail_contexts = 1;
  const auto rows = run_eval(cfg, nullptr);
  ASSERT_EQ(rows.size(), 1u + 2 + 1 + 1 + 2);
  auto find = [&](const std::string& sel, int b) {
    for (const auto& r : rows)
      if (r.selector == sel && r.budget == b) return r;
    ADD_FAILURE() << sel << " " << b << " missing";
    return EvalRow{};
  };
  for (int b : {32, 64}) {
    const EvalRow fixed = find("locks", b), low = find("locks/bytes=0.7", b);
    EXPECT_EQ(fixed.budget_mean, b);  // ~32 pages: k pages at every selection
    EXPECT_EQ(fixed.budget_p95, b);
    EXPECT_TRUE(std::isnan(fixed.mass_target_met));
    EXPECT_LT(low.bytes_read_per_step, fixed.bytes_read_per_step);  // fewer summary bytes, same k
  }
  for (const char* sel : {"locks/p=0.5/max=64", "locks/cert=0.5/max=64"}) {
    const EvalRow r = find(sel, 64);
    EXPECT_GE(r.budget_p50, 32);
    EXPECT_LE(r.budget_p95, 64);
    EXPECT_GE(r.mass_target_met, 0.0);
    EXPECT_LE(r.mass_target_met, 1.0);
  }
  EXPECT_LT(find("locks/p=0.5/max=64", 64).budget_mean, 64);  // some heads stop early
  EXPECT_GT(find("full", 0).budget_mean, 480);
  // tails.csv: a header and one row per (layer, KV head, full page) of the context.
  std::ifstream tails(std::filesystem::path(cfg.out_dir) / "tails.csv");
  const auto lines = std::count(std::istreambuf_iterator<char>(tails), std::istreambuf_iterator<char>(), '\n');
  const LlamaModel model = LlamaModel::load(cfg.model_path);
  EXPECT_EQ(lines % (model.hp.n_layer * model.hp.n_head_kv), 1);
  EXPECT_GT(lines, 8 * model.hp.n_layer * model.hp.n_head_kv);
  // Read back: the same rows (written again, the same bytes), and the same report.
  const auto back = read_eval_rows({(std::filesystem::path(cfg.out_dir) / "results.csv").string()});
  ASSERT_EQ(back.size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(back[i].selector, rows[i].selector);
    EXPECT_EQ(back[i].budget, rows[i].budget);
    EXPECT_EQ(back[i].correct, rows[i].correct);
    EXPECT_EQ(back[i].task_seed, rows[i].task_seed);
  }
  EvalConfig again;
  again.out_dir = cfg.out_dir + "-back";
  again.from_csv = {"results.csv"};
  const EvalConfig used = report_eval_rows(again, back);
  const auto slurp = [](const std::filesystem::path& p) {
    std::ifstream in(p);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(slurp(std::filesystem::path(again.out_dir) / "results.csv"),
            slurp(std::filesystem::path(cfg.out_dir) / "results.csv"));
  EXPECT_EQ(used.selectors, cfg.selectors);
  EXPECT_EQ(used.budgets, cfg.budgets);
  EXPECT_EQ(used.contexts, 1);
  // The tables from the read-back rows equal those of the run's own rows (summary.md's body, up to
  // its tail finding, which the CSV does not carry).
  const auto body = [](const std::string& md) {
    const size_t start = md.find("\n## "), tail = md.find("## tail finding");
    return md.substr(start, tail == std::string::npos ? std::string::npos : tail - start);
  };
  EXPECT_EQ(body(slurp(std::filesystem::path(again.out_dir) / "summary.md")),
            body(slurp(std::filesystem::path(cfg.out_dir) / "summary.md")));
  EXPECT_THROW(read_eval_rows({cfg.model_path}), std::runtime_error);
  // A row given twice (the same file twice) is refused; CRLF endings and a BOM are not; NaN text is.
  const std::string csv = (std::filesystem::path(cfg.out_dir) / "results.csv").string();
  EXPECT_NE(test::error_of<std::runtime_error>([&] { read_eval_rows({csv, csv}); }).find("already"), std::string::npos);
  std::string text = slurp(csv), crlf = "\xEF\xBB\xBF";
  for (char ch : text) crlf += ch == '\n' ? std::string("\r\n") : std::string(1, ch);
  const std::string dos = (std::filesystem::path(cfg.out_dir) / "dos.csv").string();
  locks::write_text_file(dos, crlf);
  EXPECT_EQ(read_eval_rows({dos}).size(), rows.size());
  const size_t comma = text.find(',', text.find('\n') + 1);
  locks::write_text_file(dos, text.substr(0, comma) + ",nan" + text.substr(text.find(',', comma + 1)));
  EXPECT_NE(test::error_of<std::runtime_error>([&] { read_eval_rows({dos}); }).find("not a finite number"),
            std::string::npos);
}

}  // namespace

namespace {

int count_svgs(const std::filesystem::path& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.path().extension() == ".svg" ? 1 : 0;
  return n;
}

}  // namespace

// A reused --out directory: the previous report (summary, locality table, plots of any length) goes,
// other files stay.
TEST(EvalReport, RemoveEvalReportTakesExactlyWhatTheReportWrites) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "locks_eval_report_remove";
  fs::remove_all(dir);
  fs::create_directories(dir);
  locks::EvalConfig cfg;
  cfg.out_dir = dir.string();
  cfg.families = {"multikey", "continuation"};
  cfg.lengths = {512, 1024};
  cfg.budgets = {32, 64};
  cfg.selectors = {"locks"};
  std::map<int, locks::TailPages> tails;
  for (int j = 0; j < 20; ++j) {
    locks::TailPage p;
    p.page = j;
    p.err_mean = 0.01 * j;
    tails[512].pages.push_back(p);
    tails[512].context.push_back(0);
  }
  std::vector<locks::EvalRow> rows;  // one per (family, length): a plot is drawn only where rows are
  for (const auto& fam : cfg.families)
    for (int len : cfg.lengths) {
      locks::EvalRow r;
      r.family = fam, r.length = len, r.selector = "locks", r.budget = 32;
      rows.push_back(r);
    }
  locks::write_eval_plots(cfg, rows, {}, {}, tails);
  const int plots = count_svgs(dir);
  ASSERT_GE(plots, 7);  // accuracy per (family, length) + carrier retention per length + the tail finding
  EXPECT_TRUE(fs::exists(dir / "tail_512.svg"));
  for (const char* report : {"summary.md", "locality.csv", "tails.csv"})
    locks::write_text_file((dir / report).string(), "x");
  const std::vector<const char*> others = {"notes.svg", "results.csv", "locality.svg", "summary.md.bak"};
  for (const char* other : others) locks::write_text_file((dir / other).string(), "x");
  EXPECT_EQ(locks::remove_eval_report(dir.string()), plots + 3);
  EXPECT_EQ(count_svgs(dir), 2);  // notes.svg, locality.svg
  EXPECT_FALSE(fs::exists(dir / "summary.md"));
  EXPECT_FALSE(fs::exists(dir / "locality.csv"));
  for (const char* other : others) EXPECT_TRUE(fs::exists(dir / other)) << other;
  EXPECT_EQ(locks::remove_eval_report((dir / "missing").string()), 0);
  fs::remove_all(dir);
}

namespace {
std::string write_temp(const std::string& name, const std::string& bytes) {
  const auto p = std::filesystem::temp_directory_path() / name;
  std::ofstream(p, std::ios::binary) << bytes;
  return p.string();
}
std::string load_error(const std::string& path) {
  try {
    locks::load_documents(path);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// Documents split at 0x1E; xz recognised by its bytes, not its name; binary input refused.
TEST(TextCorpus, SplitsDocumentsAndRecognisesXzByContent) {
  const auto docs = locks::load_documents(write_temp("locks_corpus_plain.txt", "first doc\x1e\x1esecond\x1e"));
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0], "first doc");
  EXPECT_EQ(docs[1], "second");
  EXPECT_NE(load_error(write_temp("locks_corpus_nul.txt", std::string("text\0more", 9))).find("NUL byte at offset 4"),
            std::string::npos);
  EXPECT_NE(load_error(write_temp("locks_corpus_fake.xz", "plain text")).find("not xz data"), std::string::npos);
  if (!locks::test::shared_available()) GTEST_SKIP() << "../shared not present";
  const std::string xz = locks::test::shared_path("data/heldout-text.txt.xz");
  std::ifstream in(xz, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto want = locks::load_documents(xz);
  EXPECT_EQ(locks::load_documents(write_temp("locks_corpus_renamed.txt", bytes)), want);  // xz under a .txt name
  EXPECT_GT(want.size(), 10u);
}
