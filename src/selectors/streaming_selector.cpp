// `streaming` (StreamingLLM's attention sink + window, Xiao et al. 2024): the sink page and the most
// recent k-1 pages, independent of the query. Reads no metadata: bytes_read = 0.
#include <algorithm>
#include <numeric>

#include "selectors/selectors.h"

namespace locks {

void StreamingSelector::do_select(const PagedKvCache&, const SelectionRequest& req, Selection& out) {
  const int n_pages = req.seq->n_pages(), k = std::max(req.budget_pages, 2);
  out.pages.clear();
  if (n_pages <= k) {
    out.pages.resize(n_pages);
    std::iota(out.pages.begin(), out.pages.end(), 0);
  } else {
    out.pages.push_back(0);
    for (int j = n_pages - (k - 1); j < n_pages; ++j) out.pages.push_back(j);
  }
  out.bytes_read = 0;
  out.all_pages = int(out.pages.size()) == n_pages;
}

}  // namespace locks
