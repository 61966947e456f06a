#include "locks/read_input.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <system_error>

#include <fmt/format.h>

namespace locks {

std::string input_name(const std::string& path, const std::string& what) {
  return path == "-" ? what + " (standard input)" : what + " '" + path + "'";
}

std::string read_input(const std::string& path, size_t max_bytes, const std::string& what) {
  const std::string name = input_name(path, what);
  std::error_code ec;
  if (path != "-" && std::filesystem::is_directory(path, ec)) throw std::runtime_error(name + " is a directory");
  // C stdio for both: a standard input that cannot be read (closed, a directory) sets ferror, where
  // std::cin would only see an end of file and the input would pass for empty.
  errno = 0;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(path == "-" ? nullptr : std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  auto reason = [] { return errno != 0 ? std::string(": ") + std::strerror(errno) : std::string(); };
  if (path != "-" && !file) throw std::runtime_error("cannot open " + name + reason());
  std::FILE* in = path == "-" ? stdin : file.get();
  std::string text;
  char buf[1 << 16];
  errno = 0;
  for (size_t got; (got = std::fread(buf, 1, sizeof buf, in)) > 0;) {
    if (got > max_bytes - text.size())
      throw std::runtime_error(
          fmt::format("{} is larger than {} MiB (an endless input such as /dev/zero?)", name, max_bytes >> 20));
    text.append(buf, got);
  }
  if (std::ferror(in)) throw std::runtime_error("cannot read " + name + reason());
  return text;
}

void require_text(const std::string& data, const std::string& path, const std::string& what) {
  if (const size_t nul = data.find('\0'); nul != std::string::npos)
    throw std::runtime_error(
        fmt::format("{} holds a NUL byte at offset {} (binary data, not text)", input_name(path, what), nul));
}

}  // namespace locks
