// Limits of the CPU page summaries (internal to src/core): Algorithm 1 and the Eq. 4 kernels size
// their stack buffers by them, and SummaryFormat::validate and build_page_summary enforce them.
#pragma once

namespace locks::summary_detail {

constexpr int kMaxHeadDim = 256;  // d
constexpr int kMaxPage = 32;      // B (and so the rank r)

}  // namespace locks::summary_detail
