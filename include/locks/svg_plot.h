// Dependency-free SVG charts for evaluation reports: line charts (e.g. coverage vs. budget per
// selector, locality fraction vs. rank) and grouped bar charts (e.g. accuracy per task and selector).
// Output is deterministic: fixed, locale-independent number formatting and no timestamps or ids
// that vary between runs, so reports diff cleanly. All text is XML-escaped.
#pragma once

#include <cmath>
#include <string>
#include <vector>

namespace locks {

/// One line of a line chart: points (x[i], y[i]); x and y must have the same length.
/// A non-finite y (NaN) breaks the line: the point is skipped and the line resumes after it.
struct PlotSeries {
  std::string name;
  std::vector<double> x, y;
};

/// Line chart, 720 x 440 px: title, axes with "nice" tick values (1, 2, 2.5, 5 x 10^k) and numeric
/// labels, gridlines, one coloured polyline with markers per series (palette of 10 colours, dashed
/// after the tenth series), a legend on the right.
/// log2_x: x axis in log2 scale with ticks at powers of two (budgets 128, 256, 512, ...); points
/// with x <= 0 are then skipped like NaN. y_min / y_max: fixed y range; NaN takes it from the data
/// (rounded out to nice ticks). Points outside a fixed range are clipped to the plot area.
/// Throws std::invalid_argument when a series has x.size() != y.size().
std::string svg_line_chart(const std::string& title, const std::string& x_label, const std::string& y_label,
                           const std::vector<PlotSeries>& series, bool log2_x = false, double y_min = NAN,
                           double y_max = NAN);

/// One group of bars (e.g. one task): values[s] is the bar of series s; a missing (values shorter
/// than the series list) or non-finite value draws no bar.
struct BarGroup {
  std::string label;
  std::vector<double> values;
};

/// Grouped bar chart, 720 x 440 px: one group per BarGroup along x, one coloured bar per series
/// inside each group, value labels on the bars (3 significant digits, e.g. "0.934", "12.5", "1234"),
/// a legend with the series names, title, y axis with nice ticks and gridlines.
/// y_min: bottom of the axis (bars rise from max(y_min, 0) when the range contains 0);
/// y_max: NaN takes it from the data. Throws std::invalid_argument when a group has more values
/// than there are series names.
std::string svg_bar_chart(const std::string& title, const std::string& y_label,
                          const std::vector<std::string>& series_names, const std::vector<BarGroup>& groups,
                          double y_min = 0, double y_max = NAN);

/// XML-escape text for element content and attribute values (& < > " ' ; control characters that
/// XML 1.0 forbids are dropped).
std::string xml_escape(const std::string& text);

/// Write `text` to `path` (binary, replacing the file). Throws std::runtime_error naming the path
/// (and the system's reason) when the file cannot be opened or written.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace locks
