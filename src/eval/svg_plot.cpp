// Dependency-free SVG line and grouped-bar charts for evaluation reports (see locks/svg_plot.h).
#include "locks/svg_plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace locks {

namespace {

constexpr double kWidth = 720, kHeight = 440;
constexpr double kLeft = 70;      // room for y tick labels and the y axis label
constexpr double kTop = 48;       // room for the title
constexpr double kClampPx = 1e5;  // pixel coordinates are clamped to +-this (far-off points are clipped anyway)

// Tableau 10: distinguishable, and still distinct in most colour-vision deficiencies.
constexpr const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
constexpr int kPaletteSize = 10;

const char* colour(size_t i) { return kPalette[i % kPaletteSize]; }
// Series past the palette repeat its colours with a dash pattern.
std::string dash_attr(size_t i) {
  const size_t cycle = i / kPaletteSize;
  if (cycle == 0) return "";
  return cycle == 1 ? " stroke-dasharray=\"6,3\"" : " stroke-dasharray=\"2,2\"";
}

// Locale-independent fixed-point formatting; "-0.00" is printed as "0.00".
std::string fixed(double v, int decimals) {
  if (!std::isfinite(v)) return "0";
  char buf[512];
  const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, decimals);
  std::string s(buf, res.ptr);
  if (s[0] == '-' && s.find_first_not_of("-0.") == std::string::npos) s.erase(0, 1);
  return s;
}

std::string strip_zeros(std::string s) {
  if (s.find('.') == std::string::npos) return s;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

// Pixel coordinate, one decimal.
std::string px(double v) { return fixed(std::clamp(v, -kClampPx, kClampPx), 1); }

// Value label with 3 significant digits: 0.934, 12.5, 0.5, 1234 (integers up to 6 digits), 1.23e+07.
std::string sig3(double v) {
  if (!std::isfinite(v)) return "";
  if (v == 0.0) return "0";
  const int e = int(std::floor(std::log10(std::abs(v))));
  if (e >= -4 && e <= 2) return strip_zeros(fixed(v, 2 - e));
  if (e >= 3 && e <= 5) return fixed(std::round(v), 0);
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific, 2);
  return std::string(buf, res.ptr);
}

// Deterministic id suffix for the clip path (FNV-1a), so several charts inlined into one HTML page
// get distinct ids while a chart's text depends only on its inputs.
std::string clip_id(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return fmt::format("locks-plot-{:016x}", h);
}

// Rough text width in px for the default sans-serif font.
double text_width(const std::string& s, double font_px) { return 0.58 * font_px * double(s.size()); }

struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;  // in axis units (log2 units for a log axis)
  std::vector<std::string> labels;
};

// Nice step (1, 2, 2.5, 5 x 10^k) for about `target` intervals over `range`; decimals to print it.
double nice_step(double range, int target, int& decimals) {
  const double raw = range / target;
  const int e = int(std::floor(std::log10(raw)));
  const double mag = std::pow(10.0, e);
  const double norm = raw / mag;
  double m = 10;
  for (double c : {1.0, 2.0, 2.5, 5.0})
    if (norm <= c * (1 + 1e-9)) {
      m = c;
      break;
    }
  const double step = m * mag;
  int ee = e + (m == 10 ? 1 : 0);
  decimals = std::max(0, -ee) + (m == 2.5 ? 1 : 0);
  decimals = std::min(decimals, 12);
  return step;
}

// Linear axis over [lo, hi]; ends that are not fixed are rounded out to multiples of the tick step.
Axis linear_axis(double lo, double hi, bool fixed_lo, bool fixed_hi, int target) {
  if (!(std::isfinite(lo) && std::isfinite(hi))) lo = 0, hi = 1;
  if (hi < lo) std::swap(lo, hi);
  if (hi == lo) {
    const double pad = lo == 0 ? 1.0 : 0.1 * std::abs(lo);
    if (!fixed_lo || fixed_hi) lo -= pad;
    if (!fixed_hi || fixed_lo) hi += pad;
  }
  int decimals = 0;
  const double step = nice_step(hi - lo, target, decimals);
  Axis a;
  a.lo = fixed_lo ? lo : std::floor(lo / step + 1e-9) * step;
  a.hi = fixed_hi ? hi : std::ceil(hi / step - 1e-9) * step;
  const double k0 = std::ceil(a.lo / step - 1e-9), k1 = std::floor(a.hi / step + 1e-9);
  for (double k = k0; k <= k1 && a.ticks.size() < 64; k += 1) {
    const double t = k * step;
    a.ticks.push_back(t);
    a.labels.push_back(fixed(t, decimals));
  }
  return a;
}

// log2 axis over [lo, hi] (log2 units): integer-exponent ends, ticks at powers of two.
Axis log2_axis(double lo, double hi) {
  Axis a;
  if (!(std::isfinite(lo) && std::isfinite(hi))) lo = 0, hi = 1;
  a.lo = std::floor(lo + 1e-9);
  a.hi = std::ceil(hi - 1e-9);
  if (a.hi <= a.lo) a.lo -= 1, a.hi += 1;
  const double step = std::max(1.0, std::ceil((a.hi - a.lo) / 10));
  for (double e = a.lo; e <= a.hi; e += step) {
    a.ticks.push_back(e);
    const double v = std::ldexp(1.0, int(e));
    if (e >= 0 && e <= 52)
      a.labels.push_back(fixed(v, 0));
    else if (e < 0 && e >= -12)
      a.labels.push_back(strip_zeros(fixed(v, int(-e))));
    else
      a.labels.push_back(fmt::format("2^{}", int(e)));
  }
  return a;
}

struct Frame {
  double x0, x1, y0, y1;  // plot area: x0 left, x1 right, y0 top, y1 bottom
};

void open_svg(std::string& o, const std::string& title) {
  o += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  o += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"Helvetica, Arial, sans-serif\">\n",
      int(kWidth), int(kHeight));
  o += fmt::format("<title>{}</title>\n", xml_escape(title));
  o += fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", int(kWidth), int(kHeight));
  o += fmt::format("<text x=\"{}\" y=\"28\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">{}</text>\n",
                   px(kWidth / 2), xml_escape(title));
}

// Horizontal gridlines, y ticks and labels, the y axis label, and the plot frame.
void draw_y_axis(std::string& o, const Frame& f, const Axis& ya, const std::string& y_label) {
  auto ymap = [&](double v) { return f.y1 - (v - ya.lo) / (ya.hi - ya.lo) * (f.y1 - f.y0); };
  o += "<g class=\"y-axis\" font-size=\"11\">\n";
  for (size_t i = 0; i < ya.ticks.size(); ++i) {
    const std::string y = px(ymap(ya.ticks[i]));
    o += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#e0e0e0\" stroke-width=\"1\"/>\n",
                     px(f.x0), y, px(f.x1), y);
    o += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333333\" stroke-width=\"1\"/>\n",
                     px(f.x0 - 5), y, px(f.x0), y);
    o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\" dy=\"0.35em\">{}</text>\n", px(f.x0 - 8), y,
                     xml_escape(ya.labels[i]));
  }
  const double cy = (f.y0 + f.y1) / 2;
  o += fmt::format(
      "<text x=\"16\" y=\"{0}\" transform=\"rotate(-90 16 {0})\" text-anchor=\"middle\" "
      "font-size=\"13\">{1}</text>\n",
      px(cy), xml_escape(y_label));
  o += "</g>\n";
}

void draw_frame(std::string& o, const Frame& f) {
  o += fmt::format(
      "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333333\" "
      "stroke-width=\"1\"/>\n",
      px(f.x0), px(f.y0), px(f.x1 - f.x0), px(f.y1 - f.y0));
}

// Legend entries stacked at the right of the plot; `line` draws a line + marker, else a square.
void draw_legend(std::string& o, const Frame& f, const std::vector<std::string>& names, bool line) {
  if (names.empty()) return;
  const double x = f.x1 + 14;
  const double spacing = std::min(18.0, (kHeight - f.y0 - 8) / double(names.size()));
  const double font = std::clamp(spacing - 6, 7.0, 12.0);
  o += fmt::format("<g class=\"legend\" font-size=\"{}\">\n", px(font));
  for (size_t i = 0; i < names.size(); ++i) {
    const double y = f.y0 + 8 + spacing * double(i);
    if (line) {
      o += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2\"{}/>\n", px(x),
                       px(y), px(x + 22), px(y), colour(i), dash_attr(i));
      o += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"{}\"/>\n", px(x + 11), px(y), colour(i));
    } else {
      o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"10\" fill=\"{}\"/>\n", px(x + 4), px(y - 5),
                       colour(i));
    }
    o += fmt::format("<text x=\"{}\" y=\"{}\" dy=\"0.35em\">{}</text>\n", px(x + 28), px(y), xml_escape(names[i]));
  }
  o += "</g>\n";
}

// Right margin that fits the legend's longest name (between 110 and 280 px).
double legend_margin(const std::vector<std::string>& names) {
  double w = 0;
  for (const auto& n : names) w = std::max(w, text_width(n, 12));
  return names.empty() ? 30.0 : std::clamp(w + 48, 110.0, 280.0);
}

}  // namespace

std::string xml_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') break;  // not allowed in XML 1.0
        out += ch;
    }
  }
  return out;
}

std::string svg_line_chart(const std::string& title, const std::string& x_label, const std::string& y_label,
                           const std::vector<PlotSeries>& series, bool log2_x, double y_min, double y_max) {
  for (const auto& s : series)
    if (s.x.size() != s.y.size())
      throw std::invalid_argument(
          fmt::format("line chart '{}': series '{}' has {} x and {} y values", title, s.name, s.x.size(), s.y.size()));
  auto usable = [&](double x, double y) { return std::isfinite(x) && std::isfinite(y) && (!log2_x || x > 0); };
  auto xt = [&](double x) { return log2_x ? std::log2(x) : x; };

  // Data extent over usable points.
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  for (const auto& s : series)
    for (size_t i = 0; i < s.x.size(); ++i)
      if (usable(s.x[i], s.y[i])) {
        xlo = std::min(xlo, xt(s.x[i]));
        xhi = std::max(xhi, xt(s.x[i]));
        ylo = std::min(ylo, s.y[i]);
        yhi = std::max(yhi, s.y[i]);
      }
  if (!std::isfinite(xlo)) xlo = 0, xhi = 1, ylo = 0, yhi = 1;  // no data: an empty unit frame
  const bool fix_lo = std::isfinite(y_min), fix_hi = std::isfinite(y_max);
  if (fix_lo) ylo = y_min;
  if (fix_hi) yhi = y_max;
  if (fix_lo && !fix_hi && yhi < ylo) yhi = ylo + 1;
  if (fix_hi && !fix_lo && ylo > yhi) ylo = yhi - 1;
  const Axis xa = log2_x ? log2_axis(xlo, xhi) : linear_axis(xlo, xhi, false, false, 6);
  const Axis ya = linear_axis(ylo, yhi, fix_lo, fix_hi, 5);

  std::vector<std::string> names;
  for (const auto& s : series) names.push_back(s.name);
  const Frame f{kLeft, kWidth - legend_margin(names), kTop, kHeight - 56};
  // Points at the ends of the x range stay clear of the frame by kXPad px.
  constexpr double kXPad = 12;
  auto xpos = [&](double axis_units) {
    return f.x0 + kXPad + (axis_units - xa.lo) / (xa.hi - xa.lo) * (f.x1 - f.x0 - 2 * kXPad);
  };
  auto xmap = [&](double v) { return xpos(xt(v)); };
  auto ymap = [&](double v) { return f.y1 - (v - ya.lo) / (ya.hi - ya.lo) * (f.y1 - f.y0); };

  std::string o;
  open_svg(o, title);
  // Vertical gridlines, x ticks and labels.
  o += "<g class=\"x-axis\" font-size=\"11\">\n";
  for (size_t i = 0; i < xa.ticks.size(); ++i) {
    const std::string x = px(xpos(xa.ticks[i]));
    o += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#e0e0e0\" stroke-width=\"1\"/>\n", x,
                     px(f.y0), x, px(f.y1));
    o += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333333\" stroke-width=\"1\"/>\n", x,
                     px(f.y1), x, px(f.y1 + 5));
    o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x, px(f.y1 + 18),
                     xml_escape(xa.labels[i]));
  }
  o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"13\">{}</text>\n", px((f.x0 + f.x1) / 2),
                   px(kHeight - 14), xml_escape(x_label));
  o += "</g>\n";
  draw_y_axis(o, f, ya, y_label);
  draw_frame(o, f);

  // Series, clipped to the plot area (a fixed y range may cut points off).
  const std::string cid = clip_id(title + "\x1f" + x_label + "\x1f" + y_label + "\x1f" + std::to_string(series.size()));
  o += fmt::format("<defs><clipPath id=\"{}\"><rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/></clipPath></defs>\n",
                   cid, px(f.x0 - 4), px(f.y0 - 4), px(f.x1 - f.x0 + 8), px(f.y1 - f.y0 + 8));
  o += fmt::format("<g class=\"series\" clip-path=\"url(#{})\">\n", cid);
  for (size_t si = 0; si < series.size(); ++si) {
    const auto& s = series[si];
    std::vector<std::string> pts;
    std::string markers;
    auto flush = [&] {
      if (pts.size() >= 2) {
        std::string joined;
        for (size_t k = 0; k < pts.size(); ++k) joined += (k ? " " : "") + pts[k];
        o += fmt::format(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" stroke-linejoin=\"round\"{} "
            "points=\"{}\"/>\n",
            colour(si), dash_attr(si), joined);
      }
      pts.clear();
    };
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!usable(s.x[i], s.y[i])) {
        flush();  // a missing point breaks the line
        continue;
      }
      const std::string cx = px(xmap(s.x[i])), cy = px(ymap(s.y[i]));
      pts.push_back(cx + "," + cy);
      markers += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"{}\"/>\n", cx, cy, colour(si));
    }
    flush();
    o += markers;
  }
  o += "</g>\n";
  draw_legend(o, f, names, /*line=*/true);
  o += "</svg>\n";
  return o;
}

std::string svg_bar_chart(const std::string& title, const std::string& y_label,
                          const std::vector<std::string>& series_names, const std::vector<BarGroup>& groups,
                          double y_min, double y_max) {
  const size_t n_series = series_names.size();
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& g : groups) {
    if (g.values.size() > n_series)
      throw std::invalid_argument(fmt::format("bar chart '{}': group '{}' has {} values for {} series", title, g.label,
                                              g.values.size(), n_series));
    for (double v : g.values)
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  const bool fix_lo = std::isfinite(y_min), fix_hi = std::isfinite(y_max);
  double ylo = fix_lo ? y_min : std::min(lo, 0.0);
  double yhi = fix_hi ? y_max : hi;
  if (!fix_hi) yhi = yhi + 0.08 * std::max(yhi - ylo, std::abs(yhi) * 1e-9);  // headroom for value labels
  if (fix_lo && !fix_hi && yhi <= ylo) yhi = ylo + 1;
  if (fix_hi && !fix_lo && ylo >= yhi) ylo = yhi - 1;
  const Axis ya = linear_axis(ylo, yhi, fix_lo, fix_hi, 5);

  // Group labels rotate when they would not fit side by side; the bottom margin grows for them.
  const double legend_w = legend_margin(series_names);
  const double plot_w = kWidth - kLeft - legend_w;
  const double gw = plot_w / double(std::max<size_t>(groups.size(), 1));
  double max_label_w = 0;
  for (const auto& g : groups) max_label_w = std::max(max_label_w, text_width(g.label, 11));
  const bool rotate_labels = max_label_w > gw - 4;
  const double bottom = rotate_labels ? std::clamp(24 + 0.5 * max_label_w, 40.0, 150.0) : 40;
  const Frame f{kLeft, kLeft + plot_w, kTop, kHeight - bottom};
  auto ymap = [&](double v) { return f.y1 - (std::clamp(v, ya.lo, ya.hi) - ya.lo) / (ya.hi - ya.lo) * (f.y1 - f.y0); };
  const double base = std::clamp(0.0, ya.lo, ya.hi);

  std::string o;
  open_svg(o, title);
  draw_y_axis(o, f, ya, y_label);

  const double bw = n_series ? 0.8 * gw / double(n_series) : 0;
  const bool rotate_values = bw < 24;
  o += "<g class=\"bars\">\n";
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& g = groups[gi];
    const double gx = f.x0 + gw * double(gi);
    for (size_t si = 0; si < g.values.size(); ++si) {
      const double v = g.values[si];
      if (!std::isfinite(v)) continue;
      const double x = gx + 0.1 * gw + bw * double(si);
      const double yv = ymap(v), yb = ymap(base);
      const double top = std::min(yv, yb), h = std::abs(yb - yv);
      o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"><title>{}: {}</title></rect>\n",
                       px(x + 0.5), px(top), px(std::max(bw - 1, 0.5)), px(h), colour(si),
                       xml_escape(series_names[si] + " / " + g.label), xml_escape(sig3(v)));
      const std::string label = xml_escape(sig3(v));
      const bool below = v < base;
      const double cx = x + bw / 2;
      if (!rotate_values) {
        const double ty = below ? yv + 12 : yv - 4;
        o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"10\">{}</text>\n", px(cx), px(ty),
                         label);
      } else {
        const double ty = below ? yv + 3 : yv - 3;
        const double font = std::clamp(bw - 1, 7.0, 10.0);
        o += fmt::format(
            "<text x=\"{0}\" y=\"{1}\" transform=\"rotate(-90 {0} {1})\" text-anchor=\"{2}\" "
            "dy=\"0.35em\" font-size=\"{3}\">{4}</text>\n",
            px(cx), px(ty), below ? "end" : "start", px(font), label);
      }
    }
  }
  o += "</g>\n";
  // Baseline and group labels.
  o += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333333\" stroke-width=\"1\"/>\n", px(f.x0),
                   px(ymap(base)), px(f.x1), px(ymap(base)));
  o += "<g class=\"x-axis\" font-size=\"11\">\n";
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const double cx = f.x0 + gw * (double(gi) + 0.5);
    if (!rotate_labels) {
      o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", px(cx), px(f.y1 + 18),
                       xml_escape(groups[gi].label));
    } else {
      const double ty = f.y1 + 12;
      o += fmt::format("<text x=\"{0}\" y=\"{1}\" transform=\"rotate(-35 {0} {1})\" text-anchor=\"end\">{2}</text>\n",
                       px(cx), px(ty), xml_escape(groups[gi].label));
    }
  }
  o += "</g>\n";
  draw_frame(o, f);
  draw_legend(o, f, series_names, /*line=*/false);
  o += "</svg>\n";
  return o;
}

void write_text_file(const std::string& path, const std::string& text) {
  errno = 0;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) {
    const int err = errno;
    throw std::runtime_error(fmt::format("cannot open '{}' for writing{}", path,
                                         err ? ": " + std::generic_category().message(err) : std::string()));
  }
  f.write(text.data(), std::streamsize(text.size()));
  f.close();
  if (!f) throw std::runtime_error(fmt::format("cannot write '{}' (disk full?)", path));
}

}  // namespace locks
