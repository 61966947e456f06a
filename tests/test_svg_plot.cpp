// SVG chart writer: well-formed XML (balanced tags), escaping, NaN gaps, log2 ticks, determinism,
// bar value labels, and file writing errors.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "locks/svg_plot.h"

using namespace locks;

namespace {

// Tiny XML tag checker: every start tag is closed by the matching end tag in order, self-closing
// tags and the <?xml ...?> declaration are skipped, and no '<' or bare '&' appears in text or
// attribute values. Returns "" when well formed, else what went wrong.
std::string check_tags(const std::string& s, int* n_elements = nullptr) {
  std::vector<std::string> stack;
  int n = 0;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '&') {
      const size_t semi = s.find(';', i);
      if (semi == std::string::npos || semi - i > 6) return "bare & at " + std::to_string(i);
      const std::string ent = s.substr(i, semi - i + 1);
      if (ent != "&amp;" && ent != "&lt;" && ent != "&gt;" && ent != "&quot;" && ent != "&apos;")
        return "unknown entity " + ent;
      i = semi + 1;
      continue;
    }
    if (s[i] != '<') {
      if (s[i] == '>') return "stray > at " + std::to_string(i);
      ++i;
      continue;
    }
    const size_t close = s.find('>', i);
    if (close == std::string::npos) return "unterminated tag";
    const std::string tag = s.substr(i + 1, close - i - 1);
    if (tag.find('<') != std::string::npos) return "'<' inside tag " + tag;
    for (size_t q = tag.find('&'); q != std::string::npos; q = tag.find('&', q + 1))
      if (tag.compare(q, 5, "&amp;") && tag.compare(q, 4, "&lt;") && tag.compare(q, 4, "&gt;") &&
          tag.compare(q, 6, "&quot;") && tag.compare(q, 6, "&apos;"))
        return "bare & in tag " + tag;
    i = close + 1;
    if (tag.empty()) return "empty tag";
    if (tag[0] == '?') {
      if (tag.back() != '?') return "bad declaration";
      continue;
    }
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) return "mismatched </" + name + ">";
      stack.pop_back();
      continue;
    }
    ++n;
    if (stack.empty() && n > 1) return "second root element";
    if (tag.back() == '/') continue;
    stack.push_back(tag.substr(0, tag.find_first_of(" \t\n")));
    // Attribute quotes must balance.
    size_t quotes = 0;
    for (char c : tag) quotes += c == '"';
    if (quotes % 2) return "unbalanced quotes in " + tag;
  }
  if (!stack.empty()) return "unclosed <" + stack.back() + ">";
  if (n_elements) *n_elements = n;
  return "";
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// Whether `word` occurs as a whole token (no letter on either side), case-insensitively: catches a
// printed "nan"/"inf" but not "dominant-baseline".
bool has_word(const std::string& s, const std::string& word) {
  auto lower = [](char c) { return char(std::tolower(static_cast<unsigned char>(c))); };
  auto alpha = [](char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0; };
  for (size_t i = 0; i + word.size() <= s.size(); ++i) {
    bool eq = true;
    for (size_t k = 0; k < word.size() && eq; ++k) eq = lower(s[i + k]) == word[k];
    if (eq && (i == 0 || !alpha(s[i - 1])) && (i + word.size() == s.size() || !alpha(s[i + word.size()]))) return true;
  }
  return false;
}

std::vector<PlotSeries> budget_series() {
  return {{"locks", {128, 256, 512, 1024}, {0.81, 0.9, 0.95, 0.99}},
          {"quest <r=8> & \"co\"", {128, 256, 512, 1024}, {0.6, NAN, 0.85, 0.93}},
          {"oracle", {128, 256, 512, 1024}, {0.9, 0.96, 0.99, 1.0}}};
}

}  // namespace

TEST(SvgPlot, TagCheckerRejectsBrokenXml) {
  EXPECT_EQ(check_tags("<svg><g></g></svg>"), "");
  EXPECT_NE(check_tags("<svg><g></svg>"), "");
  EXPECT_NE(check_tags("<svg>a & b</svg>"), "");
  EXPECT_NE(check_tags("<svg>a < b</svg>"), "");
  EXPECT_NE(check_tags("<svg></svg><svg></svg>"), "");
}

TEST(SvgPlot, LineChartWellFormedAndEscaped) {
  const auto series = budget_series();
  const std::string svg =
      svg_line_chart("Coverage <vs> budget & \"rank\"", "budget (tokens)", "coverage", series, true);
  int n = 0;
  EXPECT_EQ(check_tags(svg, &n), "") << svg;
  EXPECT_GT(n, 30);
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_NE(svg.find("width=\"720\""), std::string::npos);
  EXPECT_NE(svg.find("height=\"440\""), std::string::npos);
  EXPECT_NE(svg.find("Coverage &lt;vs&gt; budget &amp; &quot;rank&quot;"), std::string::npos);
  EXPECT_NE(svg.find(">locks<"), std::string::npos);
  EXPECT_NE(svg.find(">quest &lt;r=8&gt; &amp; &quot;co&quot;<"), std::string::npos);
  EXPECT_EQ(svg.find("quest <r=8>"), std::string::npos);
  EXPECT_NE(svg.find(">oracle<"), std::string::npos);
  EXPECT_NE(svg.find(">budget (tokens)<"), std::string::npos);
  EXPECT_NE(svg.find(">coverage<"), std::string::npos);
  EXPECT_FALSE(has_word(svg, "nan"));
  EXPECT_FALSE(has_word(svg, "inf"));
  // Each series its own colour.
  EXPECT_NE(svg.find("#1f77b4"), std::string::npos);
  EXPECT_NE(svg.find("#ff7f0e"), std::string::npos);
  EXPECT_NE(svg.find("#2ca02c"), std::string::npos);
}

TEST(SvgPlot, NanPointsBreakTheLine) {
  // 4 points with a NaN in the middle: markers for 3, and two segments of which only [2, 3] has
  // two points; a lone leading point gets a marker but no polyline.
  const std::vector<PlotSeries> s = {{"gap", {1, 2, 3, 4}, {1.0, NAN, 3.0, 4.0}}};
  const std::string svg = svg_line_chart("t", "x", "y", s);
  EXPECT_EQ(check_tags(svg), "");
  EXPECT_EQ(count(svg, "<polyline"), 1u);
  EXPECT_EQ(count(svg, "<circle"), 3u + 1u);  // 3 points + the legend marker
  EXPECT_FALSE(has_word(svg, "nan"));

  const std::vector<PlotSeries> s2 = {{"two", {1, 2, 3, 4, 5}, {1.0, 2.0, NAN, 4.0, 5.0}}};
  const std::string svg2 = svg_line_chart("t", "x", "y", s2);
  EXPECT_EQ(count(svg2, "<polyline"), 2u);
  EXPECT_EQ(count(svg2, "<circle"), 4u + 1u);
}

TEST(SvgPlot, Log2AxisTicksArePowersOfTwo) {
  const std::string svg = svg_line_chart("t", "budget", "y", budget_series(), /*log2_x=*/true);
  for (const char* t : {">128<", ">256<", ">512<", ">1024<"}) EXPECT_NE(svg.find(t), std::string::npos) << t;
  EXPECT_EQ(svg.find(">384<"), std::string::npos);
  EXPECT_EQ(svg.find(">768<"), std::string::npos);
  // Equal spacing on the log axis: the 128..256 and 512..1024 intervals have the same pixel width.
  auto tick_x = [&](const std::string& label) {
    const size_t p = svg.find(">" + label + "<");
    const size_t xs = svg.rfind("x=\"", p);
    return std::stod(svg.substr(xs + 3));
  };
  EXPECT_NEAR(tick_x("256") - tick_x("128"), tick_x("1024") - tick_x("512"), 0.11);
  EXPECT_GT(tick_x("256"), tick_x("128"));

  // A linear x axis with the same data has nice ticks (multiples of 200) instead.
  const std::string lin = svg_line_chart("t", "budget", "y", budget_series(), false);
  EXPECT_NE(lin.find(">200<"), std::string::npos);
  EXPECT_NE(lin.find(">1000<"), std::string::npos);
  EXPECT_EQ(check_tags(lin), "");
}

TEST(SvgPlot, NiceYTicksAndFixedRange) {
  const std::string svg = svg_line_chart("t", "x", "y", budget_series(), true, 0.0, 1.0);
  for (const char* t : {">0.0<", ">0.2<", ">0.4<", ">0.6<", ">0.8<", ">1.0<"})
    EXPECT_NE(svg.find(t), std::string::npos) << t;
  // From data (0.6 .. 1.0): ticks are round numbers.
  const std::string auto_svg = svg_line_chart("t", "x", "y", budget_series(), true);
  for (const char* t : {">0.6<", ">0.7<", ">0.8<", ">0.9<", ">1.0<"})
    EXPECT_NE(auto_svg.find(t), std::string::npos) << t;
  EXPECT_EQ(auto_svg.find(">0.5<"), std::string::npos);
  // Degenerate and empty inputs still render.
  EXPECT_EQ(check_tags(svg_line_chart("flat", "x", "y", {{"c", {1, 2}, {5, 5}}})), "");
  EXPECT_EQ(check_tags(svg_line_chart("empty", "x", "y", {})), "");
  EXPECT_EQ(check_tags(svg_line_chart("all nan", "x", "y", {{"n", {1, 2}, {NAN, NAN}}}, true)), "");
  EXPECT_THROW(svg_line_chart("bad", "x", "y", {{"n", {1, 2}, {1}}}), std::invalid_argument);
}

TEST(SvgPlot, DeterministicOutput) {
  const auto a = svg_line_chart("Coverage", "budget", "coverage", budget_series(), true);
  const auto b = svg_line_chart("Coverage", "budget", "coverage", budget_series(), true);
  EXPECT_EQ(a, b);
  const std::vector<BarGroup> g = {{"needle", {0.934, 0.5}}, {"qa", {0.71, 0.62}}};
  EXPECT_EQ(svg_bar_chart("acc", "accuracy", {"locks", "quest"}, g),
            svg_bar_chart("acc", "accuracy", {"locks", "quest"}, g));
  // Many series cycle the palette with dash patterns; still well formed.
  std::vector<PlotSeries> many;
  for (int i = 0; i < 14; ++i)
    many.push_back({std::string("s").append(std::to_string(i)), {1, 2, 3}, {double(i), i + 1.0, i + 0.5}});
  const auto m = svg_line_chart("many", "x", "y", many);
  EXPECT_EQ(check_tags(m), "");
  EXPECT_NE(m.find("stroke-dasharray"), std::string::npos);
}

TEST(SvgPlot, BarChartValuesAndLegend) {
  const std::vector<std::string> names = {"locks", "quest & co", "oracle"};
  const std::vector<BarGroup> groups = {
      {"needle <4k>", {0.934, 0.5, 1.0}}, {"summ", {12.5, 1234, NAN}}, {"short", {0.25}}};
  const std::string svg = svg_bar_chart("Accuracy by \"task\"", "score", names, groups);
  EXPECT_EQ(check_tags(svg), "") << svg;
  for (const char* t : {">0.934<", ">0.5<", ">1<", ">12.5<", ">1234<", ">0.25<"})
    EXPECT_NE(svg.find(t), std::string::npos) << t;
  EXPECT_NE(svg.find(">quest &amp; co<"), std::string::npos);
  EXPECT_NE(svg.find(">needle &lt;4k&gt;<"), std::string::npos);
  EXPECT_NE(svg.find("Accuracy by &quot;task&quot;"), std::string::npos);
  EXPECT_FALSE(has_word(svg, "nan"));
  // 6 finite values -> 6 bars (each with a <title> tooltip), plus 3 legend swatches and the background.
  EXPECT_EQ(count(svg, "<rect"), 6u + 3u + 1u + 1u);  // + the plot frame
  EXPECT_EQ(count(svg, "</rect>"), 6u);
  // Fixed range and negative values.
  const std::string neg =
      svg_bar_chart("delta", "d", {"a", "b"}, {{"g1", {-0.3, 0.2}}, {"g2", {0.1, -0.05}}}, -0.5, 0.5);
  EXPECT_EQ(check_tags(neg), "");
  EXPECT_NE(neg.find(">-0.3<"), std::string::npos);
  EXPECT_NE(neg.find(">-0.4<"), std::string::npos);  // ticks at multiples of 0.2 inside the fixed range
  EXPECT_THROW(svg_bar_chart("bad", "y", {"a"}, {{"g", {1, 2}}}), std::invalid_argument);
  // Many narrow bars with long group labels: rotated labels, still well formed.
  std::vector<BarGroup> wide;
  for (int i = 0; i < 9; ++i)
    wide.push_back({std::string("a-rather-long-task-name-").append(std::to_string(i)), {0.1, 0.2, 0.3}});
  EXPECT_EQ(check_tags(svg_bar_chart("wide", "y", names, wide)), "");
}

TEST(SvgPlot, WriteTextFile) {
  const auto path = (std::filesystem::temp_directory_path() / "locks_svg_plot_test.svg").string();
  const std::string svg = svg_line_chart("t", "x", "y", budget_series(), true);
  write_text_file(path, svg);
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_EQ(ss.str(), svg);
  std::remove(path.c_str());
  const std::string bad = "/nonexistent-locks-dir/sub/plot.svg";
  try {
    write_text_file(bad, svg);
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
}
