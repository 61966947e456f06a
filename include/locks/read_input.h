// Reading a whole text input (a prompt or a corpus file) with a size limit, so that an endless
// source (/dev/zero, a pipe that never closes) ends in a clear error instead of exhausting memory;
// and refusing binary data where text is expected.
#pragma once

#include <cstddef>
#include <string>

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

}  // namespace locks
