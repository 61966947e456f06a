// Concrete selectors (internal header). Public construction goes through make_selector().
#pragma once

#include <string>
#include <vector>

#include "locks/selector.h"

namespace locks {

/// Valid tokens in page-table position j of seq (B except for a partial last page).
inline int page_tokens(const KvSequence& seq, int j, int B) {
  return j == seq.n_pages() - 1 ? seq.n_tokens - j * B : B;
}

class FullSelector final : public Selector {
 public:
  std::string name() const override { return "full"; }
  void select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<FullSelector>(*this); }
};

class OracleSelector final : public Selector {
 public:
  explicit OracleSelector(GroupRule rule) : rule_(rule) {}
  std::string name() const override { return "oracle"; }
  void select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<OracleSelector>(*this); }

 private:
  GroupRule rule_;
};

class LocksSelector final : public Selector {
 public:
  LocksSelector(const KvCacheConfig& cfg, const SummaryFormat& fmt, GroupRule rule);
  std::string name() const override;
  void on_pages_filled(const PagedKvCache& cache, int il, std::span<const int32_t> page_ids) override;
  void select(const PagedKvCache& cache, const SelectionRequest& req, Selection& out) override;
  std::unique_ptr<Selector> clone() const override { return std::make_unique<LocksSelector>(*this); }
  const PageSummaryStore& store() const { return store_; }

 private:
  PageSummaryStore store_;
  GroupRule rule_;
};

}  // namespace locks
