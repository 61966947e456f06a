#include "paths.h"

#include <filesystem>
#include <system_error>
#include <vector>

namespace locks::cli {

std::string resolve_default_path(const std::string& rel) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> roots = {fs::current_path(ec)};
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) roots.push_back(exe.parent_path().parent_path().parent_path());
#ifdef LOCKS_SOURCE_ROOT
  roots.emplace_back(LOCKS_SOURCE_ROOT);
#endif
  for (const auto& r : roots) {
    const fs::path p = r / rel;
    if (fs::exists(p, ec)) return p.lexically_normal().string();
  }
  return rel;
}

}  // namespace locks::cli
