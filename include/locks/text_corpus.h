// Held-out documents for evaluation haystacks: a .txt or .txt.xz file of documents separated by the
// byte 0x1E (the format of ../shared/data/heldout-text.txt.xz).
#pragma once

#include <string>
#include <vector>

namespace locks {

/// Read every document (0x1E-separated). xz data (recognised by its magic bytes, whatever the file's
/// name) is decompressed with liblzma. Throws std::runtime_error naming the file on I/O or
/// decompression errors, a file named .xz that is not xz data, a NUL byte in the text (binary
/// input), or when it holds no non-empty document.
std::vector<std::string> load_documents(const std::string& path);

}  // namespace locks
