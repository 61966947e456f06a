// Locating the files the command line defaults to (the embedded model and example prompt).
#pragma once

#include <string>

namespace locks::cli {

/// Resolve a repository-relative default like "models/locks-ref-a-q8_0.gguf": tried relative to the
/// current directory, then to the executable's ../.. (build/bin/locks -> repo root), then to the
/// source tree the binary was built from. Returns the first that exists, else `rel` unchanged
/// (so the caller's open error names it).
std::string resolve_default_path(const std::string& rel);

}  // namespace locks::cli
