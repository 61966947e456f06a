// Text inputs: the held-out documents of evaluation haystacks (a .txt or .txt.xz file of documents
// separated by the byte 0x1E, the format of ../shared/data/heldout-text.txt.xz), and the bounded
// reading and text check they share with the command line's prompt files: an endless source
// (/dev/zero, a pipe that never closes) ends in a clear error instead of exhausting memory, and
// binary data is refused where text is expected.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace locks {

/// The whole content of `path` ("-": standard input), at most `max_bytes` bytes.
/// `what` names the input in errors ("prompt file", "text corpus").
/// Throws std::runtime_error naming `what` and the path when it is a directory, cannot be opened or
/// read, or holds more than `max_bytes` bytes.
std::string read_input(const std::string& path, size_t max_bytes, const std::string& what);

/// How errors name an input: "<what> '<path>'", or "<what> (standard input)" for path "-".
std::string input_name(const std::string& path, const std::string& what);

/// Text only where text is expected: throws std::runtime_error "<what> '<path>' holds a NUL byte at
/// offset N (binary data, not text)" (path "-": "<what> (standard input) ...") if `data` has one.
void require_text(const std::string& data, const std::string& path, const std::string& what);

/// Read every document (0x1E-separated). xz data (recognised by its magic bytes, whatever the file's
/// name) is decompressed with liblzma. Throws std::runtime_error naming the file on I/O or
/// decompression errors, a file named .xz that is not xz data, a NUL byte in the text (binary
/// input), or when it holds no non-empty document.
std::vector<std::string> load_documents(const std::string& path);

}  // namespace locks
